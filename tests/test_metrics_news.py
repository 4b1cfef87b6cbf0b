"""The Transform and Tell reference's compute_metrics.py figures (entities and proper nouns with
counts, both rare-name variants, length / distinct words / TTR / Flesch of both sides): against
hand-computed values and a re-statement of the reference's formulas; a fake NER (a plain
callable) is injected through the public API, spaCy itself is tested where a model is installed;
``tellkit score --metrics entities`` on text files and on the reference's generations.jsonl."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from tellkit.cli import main as cli_main
from tellkit.errors import TellkitError
from tellkit.metrics.linguistic import linguistic_scores
from tellkit.metrics.ner import entity_scores, scores_from_analysed
from tellkit.metrics.news import news_caption_scores, read_vocabulary, score_generations

# text -> (entities, PROPN tokens), the fake NER's whole knowledge
ANNOTATIONS = {
    "Obama and Biden in Paris on Monday": ([("Obama", "PERSON"), ("Biden", "PERSON"), ("Paris", "GPE"),
                                            ("Monday", "DATE")], ["Obama", "Biden", "Paris", "Monday"]),
    "Obama speaks in Paris at the UN": ([("Obama", "PERSON"), ("Paris", "GPE"), ("UN", "ORG")],
                                        ["Obama", "Paris", "UN"]),
    "a dog in the park": ([], []),
    "a dog in Central Park": ([("Central Park", "LOC")], ["Central", "Park"]),
    "Zed Quux at Google": ([("Zed Quux", "PERSON"), ("Google", "ORG")], ["Zed", "Quux", "Google"]),
    "Zed Quux at Google in 2019": ([("Zed Quux", "PERSON"), ("Google", "ORG"), ("2019", "DATE")],
                                   ["Zed", "Quux", "Google"]),
    "a cat": ([], []),
}
PRED = {"1": "Obama and Biden in Paris on Monday", "2": "a dog in the park", "3": "Zed Quux at Google"}
REF = {"1": "Obama speaks in Paris at the UN", "2": "a dog in Central Park", "3": "Zed Quux at Google in 2019"}
TRAIN_CAPTION_NAMES = {"Obama", "Paris", "Park"}
TRAIN_ARTICLE_NAMES = {"Google", "UN", "Monday"}


def fake_ner(text):
    return ANNOTATIONS[text]


# hand-computed (see the comments): (precision count, generated, recall count, reference)
HAND = {
    # generated 4+0+2, reference 3+1+3; Obama, Paris, Zed Quux, Google match both ways
    "entities": (4, 6, 4, 7),
    "person": (2, 3, 2, 2),  # generated Obama, Biden, Zed Quux; reference Obama, Zed Quux
    "gpe": (1, 1, 1, 1),
    "org": (1, 1, 1, 2),  # reference UN is not generated
    "date": (0, 1, 0, 1),  # Monday against 2019: defined, and 0
    # PROPN: generated Obama Biden Paris Monday | - | Zed Quux Google; reference Obama Paris UN |
    # Central Park | Zed Quux Google
    "proper_nouns": (5, 7, 5, 8),
    # not in {Obama, Paris, Park}: generated Biden Monday Zed Quux Google, reference UN Central Zed Quux Google
    "rare_proper_nouns": (3, 5, 3, 5),
    # not in those and {Google, UN, Monday}: generated Biden Zed Quux, reference Central Zed Quux
    "rare_proper_nouns_article": (2, 3, 2, 3),
}


def _check_hand(got):
    for group, (pc, pt, rc, rt) in HAND.items():
        assert (got[f"{group}_precision_count"], got[f"{group}_precision_total"]) == (pc, pt), group
        assert (got[f"{group}_recall_count"], got[f"{group}_recall_total"]) == (rc, rt), group
        assert got[f"{group}_precision"] == pytest.approx(100 * pc / pt), group
        assert got[f"{group}_recall"] == pytest.approx(100 * rc / rt), group


def test_entities_and_names_by_hand_with_an_injected_ner():
    got = entity_scores(PRED, REF, nlp=fake_ner, train_words=TRAIN_CAPTION_NAMES, article_words=TRAIN_ARTICLE_NAMES)
    _check_hand(got)
    assert got["date_precision"] == 0.0 and got["date_recall"] == 0.0  # 0 of 1 is 0, not undefined


def test_undefined_ratios_are_none_never_zero():
    got = entity_scores({"a": "a dog in the park"}, {"a": "a cat"}, nlp=fake_ner, train_words=set())
    for group in ("entities", "person", "gpe", "org", "date", "proper_nouns", "rare_proper_nouns"):
        assert got[f"{group}_precision"] is None and got[f"{group}_recall"] is None
        assert got[f"{group}_precision_total"] == 0 and got[f"{group}_recall_total"] == 0
    # recall defined (a reference entity), precision not (nothing generated)
    got = entity_scores({"a": "a dog in the park"}, {"a": "Obama speaks in Paris at the UN"}, nlp=fake_ner)
    assert got["entities_precision"] is None and got["entities_recall"] == 0.0
    assert "rare_proper_nouns_precision" not in got and "rare_proper_nouns_article_recall" not in got
    assert json.loads(json.dumps(got))["person_precision"] is None  # JSON null


def _reference_formulas(objs, caption_counter, full_counter):
    """A re-statement of the reference's compute_metrics.py on its generation records: entity
    counts with a text-and-label match, PROPN name counts, rare names outside a counter, lengths
    and distinct words after punctuation removal, stored TTR and Flesch averaged."""
    import re

    def contains(ents, target):
        return any(e["text"] == target["text"] and e["label"] == target["label"] for e in ents)

    c = {}

    def add(key, n):
        c[key] = c.get(key, 0) + n

    for o in objs:
        for label, name in ((None, "entities"), ("PERSON", "person"), ("GPE", "gpe"), ("ORG", "org"),
                            ("DATE", "date")):
            cap = [e for e in o["caption_entities"] if label is None or e["label"] == label]
            gen = [e for e in o["generated_entities"] if label is None or e["label"] == label]
            add(f"{name}_recall_total", len(cap))
            add(f"{name}_precision_total", len(gen))
            add(f"{name}_precision_count", sum(contains(cap, e) for e in gen))
            add(f"{name}_recall_count", sum(contains(gen, e) for e in cap))
        for counter, name in ((None, "proper_nouns"), (caption_counter, "rare_proper_nouns"),
                              (full_counter, "rare_proper_nouns_article")):
            cap = [n for n in o["caption_names"] if counter is None or n not in counter]
            gen = [n for n in o["generated_names"] if counter is None or n not in counter]
            add(f"{name}_recall_count", sum(n in o["generated_names"] for n in cap))
            add(f"{name}_recall_total", len(cap))
            add(f"{name}_precision_count", sum(n in o["caption_names"] for n in gen))
            add(f"{name}_precision_total", len(gen))
    out = dict(c)
    for key in [k for k in c if k.endswith("_count")]:
        total = c[key.replace("_count", "_total")]
        out[key.replace("_count", "")] = 100 * c[key] / total if total else None
    gen_words = [re.sub(r"[^\w\s]", "", o["generation"]).split() for o in objs]
    cap_words = [re.sub(r"[^\w\s]", "", o["raw_caption"]).split() for o in objs]
    out["length"] = sum(map(len, gen_words)) / len(objs)
    out["reference_length"] = sum(map(len, cap_words)) / len(objs)
    out["unique_words"] = sum(len(set(w)) for w in gen_words) / len(objs)
    out["reference_unique_words"] = sum(len(set(w)) for w in cap_words) / len(objs)
    out["ttr"] = 100 * sum(o["gen_np"]["basic_ttr"] for o in objs) / len(objs)
    out["reference_ttr"] = 100 * sum(o["caption_np"]["basic_ttr"] for o in objs) / len(objs)
    out["flesch"] = sum(o["gen_readability"]["flesch_reading_ease"] for o in objs) / len(objs)
    out["reference_flesch"] = sum(o["caption_readability"]["flesch_reading_ease"] for o in objs) / len(objs)
    return out


def _generation_records():
    """The reference evaluator's records for PRED / REF (its stored annotations: the fake NER's)."""
    objs = []
    for n, k in enumerate(PRED):
        g, r = ANNOTATIONS[PRED[k]], ANNOTATIONS[REF[k]]
        objs.append({
            "generation": PRED[k], "raw_caption": REF[k], "caption": REF[k].lower(),
            "generated_entities": [{"text": t, "label": lab, "tokens": []} for t, lab in g[0]],
            "caption_entities": [{"text": t, "label": lab, "tokens": []} for t, lab in r[0]],
            "generated_names": g[1], "caption_names": r[1],
            "gen_np": {"basic_ttr": 1.0 - 0.1 * n}, "caption_np": {"basic_ttr": 0.9},
            "gen_readability": {"flesch_reading_ease": 70.0 + n}, "caption_readability": {"flesch_reading_ease": 60.5},
        })
    return objs


def test_generations_match_the_restated_reference_formulas():
    objs = _generation_records()
    got = score_generations(objs, train_words=TRAIN_CAPTION_NAMES, article_words=TRAIN_ARTICLE_NAMES,
                            nlp=lambda text: pytest.fail("stored annotations need no NER"))
    expected = _reference_formulas(objs, TRAIN_CAPTION_NAMES, TRAIN_CAPTION_NAMES | TRAIN_ARTICLE_NAMES)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    _check_hand(got)
    assert got["n"] == 3 and got["stored_annotations"] == 3
    assert got["length"] == pytest.approx(16 / 3) and got["reference_length"] == pytest.approx(6.0)
    assert got["ttr"] == pytest.approx(90.0) and got["flesch"] == pytest.approx(71.0)


def test_generations_without_annotations_are_analysed():
    objs = [{"generation": PRED[k], "raw_caption": REF[k]} for k in PRED]
    got = score_generations(objs, train_words=TRAIN_CAPTION_NAMES, article_words=TRAIN_ARTICLE_NAMES, nlp=fake_ner)
    _check_hand(got)
    assert got["stored_annotations"] == 0 and got["ttr"] == linguistic_scores(PRED.values())["ttr"]


def test_linguistic_measures_of_both_sides():
    got = news_caption_scores(PRED, REF, nlp=fake_ner)
    assert got["length"] == pytest.approx(16 / 3) and got["reference_length"] == pytest.approx(6.0)
    assert got["unique_words"] == pytest.approx(16 / 3) and got["ttr"] == pytest.approx(100.0)
    assert got["reference_ttr"] == pytest.approx(100.0) and got["reference_flesch"] is not None
    # case is kept, as the reference's TTR: "The" and "the" are two types
    assert linguistic_scores(["The dog and the cat"])["ttr"] == pytest.approx(100.0)
    assert set(linguistic_scores([]).values()) == {None}


def test_scores_from_analysed_counts_duplicates_as_the_reference():
    got = scores_from_analysed([([("Obama", "PERSON")] * 2, ["Obama", "Obama"], [("Obama", "PERSON")], ["Obama"])])
    assert (got["entities_precision_count"], got["entities_precision_total"]) == (2, 2)
    assert (got["proper_nouns_recall_count"], got["proper_nouns_recall_total"]) == (1, 1)


def test_vocabulary_files(tmp_path):
    (tmp_path / "w.txt").write_text("Obama\nParis\n\n")
    (tmp_path / "c.json").write_text(json.dumps({"Obama": 3, "Paris": 1}))
    (tmp_path / "l.json").write_text(json.dumps(["Obama", "Paris"]))
    for name in ("w.txt", "c.json", "l.json"):
        assert read_vocabulary(str(tmp_path / name)) == {"Obama", "Paris"}
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(TellkitError, match="JSON list of words"):
        read_vocabulary(str(tmp_path / "bad.json"))


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def test_cli_scores_the_reference_generations(tmp_path):
    gen = tmp_path / "generations.jsonl"
    gen.write_text("".join(json.dumps(o) + "\n" for o in _generation_records()))
    (tmp_path / "caps.txt").write_text("\n".join(sorted(TRAIN_CAPTION_NAMES)))
    (tmp_path / "arts.json").write_text(json.dumps({w: 1 for w in TRAIN_ARTICLE_NAMES}))
    rc, out, err = _cli("score", "--generations", gen, "--caption-names", tmp_path / "caps.txt",
                        "--article-names", tmp_path / "arts.json")
    assert rc == 0, err
    got = json.loads(out)["entities"]
    _check_hand(got)
    assert got["flesch"] == pytest.approx(71.0)


def test_cli_reads_the_reference_name_counters_without_running_code(tmp_path):
    import pickle
    from collections import Counter

    gen = tmp_path / "generations.jsonl"
    gen.write_text("".join(json.dumps(o) + "\n" for o in _generation_records()))
    counters = {"caption": Counter(sorted(TRAIN_CAPTION_NAMES)), "context": Counter(sorted(TRAIN_ARTICLE_NAMES))}
    (tmp_path / "name_counters.pkl").write_bytes(pickle.dumps(counters))
    rc, out, err = _cli("score", "--generations", gen, "--name-counters", tmp_path / "name_counters.pkl")
    assert rc == 0, err
    _check_hand(json.loads(out)["entities"])
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps({"caption": Counter(), "context": TellkitError("x")}))
    rc, _, err = _cli("score", "--generations", gen, "--name-counters", tmp_path / "evil.pkl")
    assert rc == 2 and "refused" in err and len(err.strip().splitlines()) == 1


def test_cli_errors_are_one_line(tmp_path):
    gen = tmp_path / "g.jsonl"
    gen.write_text('{"generation": "x"}\n')
    rc, _, err = _cli("score", "--generations", gen)
    assert rc == 2 and "raw_caption" in err and len(err.strip().splitlines()) == 1
    rc, _, err = _cli("score", "--predictions", gen)
    assert rc == 2 and "--references" in err
    rc, _, err = _cli("score", "--generations", gen, "--metrics", "caption", "--caption-names", gen)
    assert rc == 2 and "entities" in err


def _spacy_model_or_skip():
    spacy = pytest.importorskip("spacy", reason="spaCy is not installed (pip install 'tellkit[metrics]')")
    from tellkit.metrics.ner import PREFERRED

    if not set(spacy.util.get_installed_models()) & set(PREFERRED):
        pytest.skip(f"no spaCy English pipeline installed (one of {', '.join(PREFERRED)})")


def test_cli_entities_on_text_files_with_spacy(tmp_path):
    _spacy_model_or_skip()
    (tmp_path / "p.txt").write_text("Barack Obama speaks in Chicago on Monday.\nA dog in the snow.\n")
    (tmp_path / "r.txt").write_text("Barack Obama speaks in Chicago on Monday.\nA cat on a mat.\n")
    (tmp_path / "t.txt").write_text("Barack Obama at the White House.\n")
    rc, out, err = _cli("score", "--predictions", tmp_path / "p.txt", "--references", tmp_path / "r.txt",
                        "--metrics", "entities", "--train-captions", tmp_path / "t.txt")
    assert rc == 0, err
    got = json.loads(out)["entities"]
    assert got["entities_precision"] == 100.0 and got["entities_recall"] == 100.0 and got["ner_model"]
    assert got["person_precision_total"] >= 1 and got["proper_nouns_recall"] == 100.0
    # Chicago / Monday are not in the training captions' proper nouns: rare, and matched
    assert got["rare_proper_nouns_precision"] == 100.0 and got["rare_proper_nouns_precision_total"] >= 1
    assert got["length"] == pytest.approx((7 + 5) / 2) and got["reference_length"] == pytest.approx((7 + 5) / 2)


def test_undefined_figures_are_a_dash_in_tables_and_the_worst_monitor_value():
    from tellkit.cli.cmd_table import markdown
    from tellkit.training.task import Task

    row = {"row": "tat", "task": "caption", "monitor": "cider", "params": 1e6, "steps": 3, "best_val": 1.0,
           "metrics": {"cider": 12.5, "entities_precision": None, "entities_recall": 40.0}}
    line = markdown([row]).splitlines()[2]
    assert "| 12.50 | - | 40.00 |" in line

    class Monitored(Task):
        name, monitor, monitor_mode = "t", "person_recall", "max"

    assert Monitored.monitor_key(Monitored.__new__(Monitored), {"person_recall": None}) == (float("-inf"),)
    assert Monitored.monitor_key(Monitored.__new__(Monitored), {"person_recall": 0.0}) == (0.0,)
