"""One inference pipeline for every task: a trained checkpoint (or the packaged default) in,
answers out. ``tellkit caption`` / ``recognize`` / ``summarize``, ``tellkit demo``, the server
and ``tellkit.pipeline(task)`` all run a :class:`Pipeline`::

    pipe = CaptioningPipeline.load()                       # the packaged default; or load("runs/x", dtype="bf16")
    pipe("photo.jpg")["text"]                              # one input -> one result
    [r["text"] for r in pipe(["a.jpg", "b.jpg"])]          # a list -> a list

A pipeline is the task's :class:`~tellkit.tasks.processor.Processor` (the same object
``tellkit evaluate`` uses, built from the recipe sections the checkpoint stores), the model, and
its typed generation settings (the stored ``eval`` section with the overrides given to
:meth:`Pipeline.load`). Inputs are read and checked first (:meth:`Pipeline.prepare`), then run
in batches through :meth:`preprocess` (inputs to the model's batch), :meth:`forward` (the
model's ``generate``, in autocast when a reduced ``dtype`` was asked for: weights stay float32)
and :meth:`postprocess` (outputs to results: ``{"text": ..., extras}``; a result may carry any
further fields). ``forward`` calls ``generate`` on :attr:`Pipeline.runner`: the model itself, or
the same model on another runtime (its ONNX graphs under ONNX Runtime), chosen by
:meth:`Pipeline.load` (``runtime=``) as evaluation chooses it (:mod:`tellkit.runtime`).

``info`` says which model runs (task, family, checkpoint, trained or not, parameters), on which
device, in which dtype (and why not the one asked for), with which generation settings.

What the server reads of a pipeline, so that it serves any task without knowing its name
(:mod:`tellkit.server.app` takes ``{task: pipeline}``): :attr:`Pipeline.api_text` (the API's name
for a result's text), :meth:`Pipeline.cost` (an input's working memory and work, for the server's
memory budget and time estimates), :attr:`Pipeline.prepares_early` (whether the server prepares
an input on its decoding threads first, because its cost depends on the prepared input) and
:attr:`Pipeline.small_lane` (whether cheap inputs may run beside a batch of large ones).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from tellkit import runtime as runtimes
from tellkit.checkpoint import load_model, read_checkpoint_config, resolve_checkpoint
from tellkit.errors import TellkitError
from tellkit.recipes import GenerationSettings, eval_batch_size, packaged_default
from tellkit.tasks.processor import Processor
from tellkit.utils import precision as precisions
from tellkit.utils.precision import resolve_device

log = logging.getLogger("tellkit")

DTYPES = ("fp32", "bf16")  # what --dtype offers; tellkit.utils.precision also reads the long names
FIXED_BYTES = 8 << 20  # an input's share of the working memory when nothing better is known


@dataclass(frozen=True)
class Cost:
    """What one input costs the model that answers it (:meth:`Pipeline.cost`)."""

    bytes: int    # estimated peak working memory of the input's share of a batch
    work: float   # relative time (the server learns seconds per unit)


def checkpoint_info(family: str, path: Path | str | None, meta: Mapping[str, Any],
                    trained: bool | None = None) -> dict[str, Any]:
    """What /health and every response say about a model. A checkpoint counts as trained when
    the training loop wrote it (its metadata has a ``train`` section) unless told otherwise."""
    if trained is None:
        trained = bool(meta.get("train")) or bool(meta.get("trained"))
    info = {"family": family, "checkpoint": str(path) if path else None, "trained": trained}
    for key in ("step", "tellkit_version", "weights_dtype", "note"):
        if key in meta:
            info[key] = meta[key]
    state = Path(path) / "trainer_state.json" if path else None
    if state is not None and state.is_file():  # a training-loop checkpoint: how far it got
        try:
            st = json.loads(state.read_text(encoding="utf-8"))
            info["train_steps"] = st.get("step")
            info["best"] = {"value": st.get("best"), "step": st.get("best_step")}
        except (OSError, ValueError):
            pass
    return info


class Pipeline:
    """See the module docstring. Subclasses set :attr:`task`, :attr:`families` and
    :attr:`processor_class`."""

    task: ClassVar[str] = ""
    families: ClassVar[tuple[str, ...]] = ()
    processor_class: ClassVar[type[Processor]] = Processor
    # options of Pipeline.load that configure the processor (the others are generation settings)
    processor_options: ClassVar[tuple[str, ...]] = ()
    # serving (see the module docstring)
    api_text: ClassVar[str] = "text"
    prepares_early: ClassVar[bool] = False
    small_lane: ClassVar[bool] = False

    def __init__(self, model, processor: Processor, generation: GenerationSettings, *,
                 info: Mapping[str, Any] | None = None, device: str | torch.device | None = None,
                 precision: precisions.Precision | None = None, batch_size: int = 8, runner: Any = None):
        self.model = model.eval()
        self.processor = processor
        self.generation = generation
        self.device = resolve_device(device)
        self.precision = precision or precisions.resolve(self.device, None)
        if isinstance(batch_size, bool) or int(batch_size) < 1:
            raise TellkitError(f"batch size must be at least 1, got {batch_size}")
        self.batch_size = int(batch_size)
        # what forward's ``generate`` runs on: the model, or its graphs on another runtime
        self.runner = self.model if runner is None else runner
        self.info: dict[str, Any] = {"name": getattr(model, "family", type(model).__name__),
                                     "parameters": sum(p.numel() for p in model.parameters()), **(info or {}),
                                     "task": self.task, "device": str(self.device), "dtype": self.precision.name}
        if self.precision.note:
            self.info["dtype_note"] = self.precision.note

    # --- loading -------------------------------------------------------------------------------
    @classmethod
    def default_model(cls) -> Path:
        """The packaged default checkpoint of the task (a one-line error when there is none)."""
        path = packaged_default(cls.task)
        if path is None:
            raise TellkitError(f"no packaged default model for '{cls.task}' is installed: pass a checkpoint "
                               "(model=DIR, --model DIR)")
        return path

    @classmethod
    def load(cls, model: str | Path | None = None, device: str | torch.device | None = None,
             dtype: str | None = None, runtime: str | None = None, **options: Any) -> Pipeline:
        """A checkpoint folder (or a run folder of ``tellkit train``: its best checkpoint); None:
        the packaged default. ``device``: cpu, cuda, cuda:N (None: the GPU when there is one, else
        the CPU; the CPU for ``runtime='onnx'``). ``dtype``: 'bf16' runs the
        search in bfloat16 autocast where the device computes it natively (else float32 and a
        note in ``info``); 'fp32' or None: float32. ``runtime``: 'torch' (None) or 'onnx' (the
        model's ONNX graphs under ONNX Runtime, same processor and search: :mod:`tellkit.runtime`;
        a checkpoint that is not an ONNX export is exported once into the user cache). ``options``: generation settings
        overriding the stored ones (``beam_size=3``; None keeps a stored value) and the task's
        input options (:attr:`processor_options`)."""
        proc_opts = {k: options.pop(k) for k in list(options) if k in cls.processor_options}
        unknown = sorted(set(options) - set(cls.processor_class.generation_class.fields()))
        if unknown:
            known = ", ".join([*cls.processor_class.generation_class.fields(), *cls.processor_options])
            raise TellkitError(f"{cls.task}: unknown option(s) {', '.join(unknown)}; known: {known}")
        path = resolve_checkpoint(model if model is not None else cls.default_model(), follow_links=False)
        meta = read_checkpoint_config(path)
        if meta.get("family") not in cls.families:
            raise TellkitError(f"{path}: holds a '{meta.get('family')}' model, not one for '{cls.task}' "
                               f"({', '.join(cls.families)})")
        # the ONNX runtime computes on the CPU: with no device named, that is where it runs
        dev = resolve_device("cpu" if device is None and runtime == "onnx" else device)
        runtimes.check_runtime(runtime, device=dev, dtype=dtype)
        granted = precisions.resolve_precision(dev, dtype)
        if granted.note:
            log.warning("%s", granted.note)
        generation = cls.processor_class.generation(meta, **options)
        processor = cls.build_processor(meta, path, dev, **proc_opts)
        net = load_model(path, map_location=dev).float()
        processor.check(net, generation)
        runner, ran_on = runtimes.generating_model(net, runtime, path, meta, processor, device=dev, dtype=dtype)
        return cls(net, processor, generation, info={**checkpoint_info(meta["family"], path, meta), **ran_on},
                   device=dev, precision=granted, batch_size=cls.stored_batch_size(processor, meta), runner=runner)

    @classmethod
    def build_processor(cls, meta: Mapping[str, Any], path: Path, device: torch.device, **options: Any) -> Processor:
        """The checkpoint's processor (:meth:`Processor.from_checkpoint`)."""
        return cls.processor_class.from_checkpoint(meta, path, device=device, **options)

    @staticmethod
    def stored_batch_size(processor: Processor, meta: Mapping[str, Any]) -> int:
        """Inputs per batch: the task's evaluation batch size (as ``tellkit evaluate``)."""
        size = getattr(processor, "batch_size", None)
        return int(size(meta)) if callable(size) else eval_batch_size(meta)

    # --- running -------------------------------------------------------------------------------
    def __call__(self, inputs: Any, *, batch_size: int | None = None, **options: Any):
        """One input -> one result; a list of inputs -> a list of results (a tuple is one input:
        an image and its article, a transcript and its video features)."""
        single = not isinstance(inputs, list) or self.processor.is_input(inputs)
        items = [inputs] if single else list(inputs)
        results = self.run(items, batch_size=batch_size, **options)
        return results[0] if single else results

    def prepare(self, items: Sequence[Any]) -> list[Any]:
        """Every input read and checked, before any model work."""
        return [self.processor.prepare(x) for x in items]

    def run(self, items: Sequence[Any], *, batch_size: int | None = None, **options: Any) -> list[dict[str, Any]]:
        """Results for ``items`` in their order, computed in batches of at most ``batch_size``
        (default: :attr:`batch_size`) as the processor groups them."""
        size = self.batch_size if batch_size is None else batch_size
        if isinstance(size, bool) or int(size) < 1:
            raise TellkitError(f"batch size must be at least 1, got {size}")
        prepared = self.prepare(items)
        results: list[dict[str, Any] | None] = [None] * len(prepared)
        for idx in self.processor.batches(prepared, int(size)):
            batch = self.preprocess([prepared[i] for i in idx])
            outputs = self.forward(batch, **self.generate_options(**options))
            for i, res in zip(idx, self.postprocess(outputs, batch, **options)):
                results[i] = res
        return results  # type: ignore[return-value]

    def preprocess(self, prepared: Sequence[Any]) -> dict[str, Any]:
        """Prepared inputs -> the model's batch, its tensors on the model's device."""
        batch = self.processor.collate(prepared, self.precision)
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def forward(self, batch: Mapping[str, Any], **extra: Any) -> Mapping[str, Any]:
        """``generate`` of :attr:`runner` (the model, on the runtime :meth:`load` chose) with the
        pipeline's generation settings and ``extra`` keyword arguments."""
        return self.processor.generate(self.runner, batch, self.generation, self.precision, **extra)

    def generate_options(self, **options: Any) -> dict[str, Any]:
        """Keyword arguments of ``generate`` beyond the generation settings, from the call's
        options (default: none; an unknown option is refused)."""
        if options:
            raise TellkitError(f"{self.task}: unknown option(s) {', '.join(sorted(options))}")
        return {}

    def postprocess(self, outputs: Mapping[str, Any], batch: Mapping[str, Any], **options: Any) -> list[dict]:
        return self.processor.decode(outputs, batch, **options)

    # --- serving -------------------------------------------------------------------------------
    def cost(self, item: Any, prepared: Any = None) -> Cost:
        """What answering ``item`` costs (``prepared``: the item as :meth:`prepare` made it, when
        the server prepared it first); default: a fixed share and one unit of work."""
        return Cost(FIXED_BYTES, 1.0)
