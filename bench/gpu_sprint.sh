#!/usr/bin/env bash
# BTTR on a GPU lent for minutes, as one command: profile the training step, train until the time
# is up, and leave everything in one flat folder (tellkit sprint; docs/bttr.md, "GPU sprints").
#
#   bench/gpu_sprint.sh DATA.tar.xz OUT [MINUTES] [START]
#
# DATA.tar.xz  the official CROHME InkML release as a tar (crohme_inkml/train, crohme_inkml/test/2014):
#              tar cf - -C PARENT_OF_crohme_inkml crohme_inkml | xz > crohme.tar.xz
# OUT          receives profile.json / profile.md, the logs, sprint.json and the last state (float16)
# MINUTES      wall-clock minutes for the whole command (default 9)
# START        weights to start from (default: the packaged model); a previous sprint's OUT goes on
#              from its last state, with the batch size its profile chose (no second profile);
#              "none" starts from random weights
#
# Runs from the repository root with the machine's own python3 and PyTorch (tellkit from src/).
# SPRINT_RECIPE (default bttr/crohme_aug) and SPRINT_ARGS (more tellkit sprint options and
# overrides, e.g. "--batch-sizes 2,4 --device cpu" for a trial run with bttr/tiny) change the run.
set -euo pipefail
data=${1:?DATA.tar.xz}; out=${2:?OUT}; minutes=${3:-9}; start=${4:-src/tellkit/assets/bttr_default}
t0=$(date +%s)
work=$(mktemp -d)
tar xJf "$data" -C "$work"
mkdir -p "$work/run" "$out"
init="train.init_from=$start"
[ "$start" = none ] && init="train.init_from=null"
for f in profile.json profile.md; do if [ -f "$start/$f" ]; then cp "$start/$f" "$work/run/"; fi; done
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
left=$(python3 -c "print(max(1.0, $minutes - ($(date +%s) - $t0) / 60 - 0.2))")
# shellcheck disable=SC2086
python3 -m tellkit sprint "${SPRINT_RECIPE:-bttr/crohme_aug}" "data.root=$work/crohme_inkml" \
    data.render.stroke_size=22 "$init" train.lr=1e-4 train.patience=null train.max_epochs=1000 \
    --out "$work/run" --minutes "$left" --export "$out" --no-progress ${SPRINT_ARGS:-} 2>&1 | tee "$out/sprint.log"
