"""Caption metrics against values computed independently of pycocoevalcap: BLEU with nltk, ROUGE-L
and CIDEr-D with the small implementations below (from the papers' formulas), METEOR on cases
whose value is known, NER matching and linguistic measures by hand."""
from __future__ import annotations

import math
from collections import Counter

import pytest

from tellkit.errors import TellkitError
from tellkit.metrics.caption import normalize, score_captions, score_captions_detailed
from tellkit.metrics.linguistic import flesch_reading_ease, linguistic_scores, syllables, type_token_ratio
from tellkit.metrics.ner import entity_scores

PRED = {
    "1": "Barack Obama speaks in Chicago on Monday.",
    "2": "A man rides a red bicycle down the street",
    "3": "Two dogs play in the snow near a fence",
}
REFS = {
    "1": ["President Barack Obama speaks in Chicago on Monday night.", "Obama at a rally in Chicago."],
    "2": ["A man is riding a red bike down the street", "A cyclist rides down a city street"],
    "3": ["Two dogs playing in the snow", "Two brown dogs play near a wooden fence in the snow"],
}


def test_normalize_keeps_case_and_drops_punctuation():
    assert normalize("Gov. Paul LePage, in  Augusta (Me.)!") == "Gov Paul LePage in Augusta Me"
    assert normalize("New York-based don't") == "New Yorkbased dont"


def _toks(d):
    return {k: [normalize(x).split() for x in (v if isinstance(v, list) else [v])] for k, v in d.items()}


def test_lowercase_compares_words_regardless_of_case():
    preds = {"1": "A dog runs on the grass", "2": "Two men play"}
    refs = {"1": ["a dog runs on the grass", "The dog runs"], "2": ["two men play football", "Two men playing"]}
    kept = score_captions(preds, refs, ["bleu", "rouge", "cider"])
    lower = score_captions(preds, refs, ["bleu", "rouge", "cider"], lowercase=True)
    assert lower["bleu1"] > kept["bleu1"] and lower["rouge_l"] > kept["rouge_l"] and lower["cider"] > kept["cider"]
    same = score_captions({k: v.lower() for k, v in preds.items()},
                          {k: [r.lower() for r in v] for k, v in refs.items()}, ["bleu", "rouge", "cider"])
    assert lower == pytest.approx(same)


def test_bleu_matches_nltk():
    from nltk.translate.bleu_score import corpus_bleu

    got = score_captions(PRED, REFS, metrics=["bleu"])
    hyp, refs = _toks(PRED), _toks(REFS)
    ids = sorted(PRED)
    for n in range(1, 5):
        want = corpus_bleu([refs[i] for i in ids], [hyp[i][0] for i in ids], weights=[1 / n] * n)
        assert got[f"bleu{n}"] == pytest.approx(100 * want, rel=1e-6)


def _lcs(a, b):
    t = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a)):
        for j in range(len(b)):
            t[i + 1][j + 1] = t[i][j] + 1 if a[i] == b[j] else max(t[i][j + 1], t[i + 1][j])
    return t[-1][-1]


def test_rouge_l_matches_formula():
    hyp, refs = _toks(PRED), _toks(REFS)
    beta = 1.2
    per = []
    for i in PRED:
        h = hyp[i][0]
        p = max(_lcs(h, r) / len(h) for r in refs[i])
        r_ = max(_lcs(h, r) / len(r) for r in refs[i])
        per.append((1 + beta**2) * p * r_ / (r_ + beta**2 * p))
    assert score_captions(PRED, REFS, metrics=["rouge"])["rouge_l"] == pytest.approx(100 * sum(per) / len(per))


def _cider_d(hyps, refs, n=4, sigma=6.0):
    """CIDEr-D (Vedantam et al. 2015, coco-caption variant): tf-idf n-gram vectors with document
    frequencies over the references of the whole set, hypothesis counts clipped by the
    reference's, Gaussian length penalty, x10. As in coco-caption, the 'length' in the penalty
    is the number of bigrams."""
    def grams(words, k):
        return Counter(tuple(words[i : i + k]) for i in range(len(words) - k + 1))

    ids = list(hyps)
    df = Counter()
    for i in ids:
        df.update({g for r in refs[i] for k in range(1, n + 1) for g in grams(r, k)})
    logn = math.log(len(ids))

    def vec(words):
        v = [{g: c * (logn - math.log(max(1.0, df[g]))) for g, c in grams(words, k).items()} for k in range(1, n + 1)]
        return v, [math.sqrt(sum(x * x for x in vk.values())) for vk in v], max(0, len(words) - 1)

    out = {}
    for i in ids:
        vh, nh, lh = vec(hyps[i])
        total = 0.0
        for r in refs[i]:
            vr, nr, lr = vec(r)
            sims = []
            for k in range(n):
                s = sum(min(x, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, x in vh[k].items())
                if nh[k] and nr[k]:
                    s /= nh[k] * nr[k]
                sims.append(s * math.exp(-((lh - lr) ** 2) / (2 * sigma**2)))
            total += sum(sims) / n
        out[i] = 10.0 * total / len(refs[i])
    return out


def test_cider_d_matches_an_independent_implementation_over_the_whole_set():
    corpus, per = score_captions_detailed(PRED, REFS, metrics=["cider"])
    hyp, refs = _toks(PRED), _toks(REFS)
    want = _cider_d({k: v[0] for k, v in hyp.items()}, refs)
    for k in PRED:
        assert per[k]["cider"] == pytest.approx(100 * want[k], rel=1e-9)
    assert corpus["cider"] == pytest.approx(100 * sum(want.values()) / 3, rel=1e-9)
    # corpus-level: document frequencies depend on the whole set, so a subset scores differently
    sub = score_captions({"1": PRED["1"]}, {"1": REFS["1"]}, metrics=["cider"])["cider"]
    assert sub != pytest.approx(per["1"]["cider"])


@pytest.mark.java
@pytest.mark.slow
def test_meteor_known_values():
    corpus, per = score_captions_detailed(
        {"same": "a brown dog runs on the grass", "none": "purple elephants", "empty": ""},
        {"same": ["a brown dog runs on the grass"], "none": ["a cat sleeps"], "empty": ["a cat sleeps"]},
        metrics=["meteor"])
    assert per["same"]["meteor"] == pytest.approx(100.0)
    assert per["none"]["meteor"] == 0.0 and per["empty"]["meteor"] == 0.0
    assert 0.0 < corpus["meteor"] < 100.0


def test_errors_are_clear():
    with pytest.raises(TellkitError, match="different ids"):
        score_captions({"a": "x"}, {"b": ["x"]})
    with pytest.raises(TellkitError, match="unknown caption metric"):
        score_captions({"a": "x"}, {"a": ["x"]}, metrics=["spice"])


def test_linguistic_by_hand():
    words = ["the", "cat", "table", "beautiful", "make", "people", "free", "whale", "Obama"]
    assert [syllables(w) for w in words] == [1, 1, 2, 3, 1, 2, 1, 1, 3]
    # "The cat sat on the mat." 6 words, 1 sentence, 6 syllables
    assert flesch_reading_ease("The cat sat on the mat.") == pytest.approx(206.835 - 1.015 * 6 - 84.6 * 1.0)
    # "A table. A beautiful whale." 5 words, 2 sentences, 1+2+1+3+1 = 8 syllables
    assert flesch_reading_ease("A table. A beautiful whale.") == pytest.approx(206.835 - 1.015 * 2.5 - 84.6 * 8 / 5)
    # case kept, as the reference's TTR; lowercase=True folds it
    assert type_token_ratio("The dog and the cat") == pytest.approx(100.0)
    assert type_token_ratio("The dog and the cat", lowercase=True) == pytest.approx(80.0)
    s = linguistic_scores(["The dog and the the cat", "A cat."])
    assert s["length"] == pytest.approx(4.0) and s["ttr"] == pytest.approx((500 / 6 + 100) / 2)
    assert s["unique_words"] == pytest.approx(3.5)


class _Tok:
    def __init__(self, text, pos):
        self.text, self.pos_ = text, pos


class _Ent:
    def __init__(self, text, label):
        self.text, self.label_ = text, label


class _Doc(list):
    ents: list


class FakeNLP:
    """Entities and proper nouns given by hand: words in CAPS-initial are PROPN; ENTS lists spans."""

    ENTS = {"Obama": "PERSON", "Barack Obama": "PERSON", "Chicago": "GPE", "Monday": "DATE", "Paris": "GPE",
            "Google": "ORG"}

    def pipe(self, texts):
        for t in texts:
            doc = _Doc(_Tok(w, "PROPN" if w[:1].isupper() and w not in ("A", "The") else "NOUN") for w in t.split())
            ents, rest = [], t
            for span in sorted(self.ENTS, key=len, reverse=True):
                if span in rest:
                    ents.append(_Ent(span, self.ENTS[span]))
                    rest = rest.replace(span, "")
            doc.ents = ents
            yield doc


def test_entity_precision_recall_by_hand():
    pred = {"1": "Barack Obama in Paris on Monday", "2": "Google office in Chicago", "3": "Zorblat and a dog"}
    ref = {"1": "Barack Obama in Chicago on Monday", "2": "Obama visits Google in Chicago", "3": "Zorblat the dog"}
    known = {"Barack", "Obama", "Paris", "Chicago", "Monday", "Google"}
    got = entity_scores(pred, ref, nlp=FakeNLP(), train_words=known)
    # generated entities: {BO, Paris, Monday}, {Google, Chicago}, {} -> 5; reference: {BO, Chicago, Monday},
    # {Obama, Google, Chicago}, {} -> 6; matches: BO, Monday, Google, Chicago -> 4
    assert got["entities_precision"] == pytest.approx(80.0) and got["entities_recall"] == pytest.approx(400 / 6)
    assert got["person_precision"] == pytest.approx(100.0) and got["person_recall"] == pytest.approx(50.0)
    assert got["gpe_precision"] == pytest.approx(50.0) and got["gpe_recall"] == pytest.approx(50.0)
    # rare proper nouns: only "Zorblat" is unseen in training; generated once, in its reference
    assert got["rare_proper_nouns_recall"] == 100.0 and got["rare_proper_nouns_precision"] == 100.0
    got = entity_scores(pred, ref, nlp=FakeNLP(), train_words={"Zorblat"})  # now Barack, Paris, ... are rare
    # generated rare {Barack, Obama, Paris, Monday}, {Google, Chicago}, {}; reference {Barack, Obama,
    # Chicago, Monday}, {Obama, Google, Chicago}, {}: 3 + 2 matches of 6 generated, 7 in references
    assert got["rare_proper_nouns_precision"] == pytest.approx(500 / 6)
    assert got["rare_proper_nouns_recall"] == pytest.approx(500 / 7)


def test_entities_with_the_spacy_model():
    pytest.importorskip("spacy")
    got = entity_scores({"a": "Barack Obama visited Paris on Monday."}, {"a": "Barack Obama visited Paris on Monday."})
    assert got["entities_precision"] == 100.0 and got["person_recall"] == 100.0


class WordNLP:
    """One entity per listed word, every occurrence (duplicates kept); capitalised words are PROPN."""

    ENTS = {"Obama": "PERSON", "Biden": "PERSON", "Paris": "GPE", "Monday": "DATE"}

    def pipe(self, texts):
        for t in texts:
            words = t.split()
            doc = _Doc(_Tok(w, "PROPN" if w[:1].isupper() else "NOUN") for w in words)
            doc.ents = [_Ent(w, self.ENTS[w]) for w in words if w in self.ENTS]
            yield doc


def test_entities_are_counted_over_lists_with_duplicates():
    # generated [Obama, Obama, Paris], reference [Obama, Biden]:
    # precise = Obama + Obama (each found in the reference list) = 2 of 3 generated;
    # recalled = Obama (found in the generated list) = 1 of 2 (as sets it would be 1/2 and 1/2)
    got = entity_scores({"a": "Obama met Obama in Paris"}, {"a": "Obama and Biden"}, nlp=WordNLP())
    assert got["entities_precision"] == pytest.approx(200 / 3) and got["entities_recall"] == pytest.approx(50.0)
    assert got["person_precision"] == pytest.approx(100.0) and got["person_recall"] == pytest.approx(50.0)
    # generated [Biden], reference [Biden, Biden, Monday]: precision 1/1, recall 2/3
    got = entity_scores({"a": "Biden"}, {"a": "Biden greets Biden on Monday"}, nlp=WordNLP())
    assert got["entities_precision"] == 100.0 and got["entities_recall"] == pytest.approx(200 / 3)


def test_rare_proper_nouns_use_training_caption_proper_nouns_only():
    from tellkit.metrics.ner import train_proper_nouns

    vocab = train_proper_nouns(["Obama spoke to reporters", "the mayor of Paris"], nlp=WordNLP())
    assert vocab == {"Obama", "Paris"}  # "the", "mayor", "reporters" are not proper nouns
    got = entity_scores({"a": "Zed and Zed met Obama"}, {"a": "Zed greets Obama in Quux"}, nlp=WordNLP(),
                        train_words=vocab)
    # rare generated [Zed, Zed] both in the reference list -> 2/2; rare reference [Zed, Quux] -> 1/2
    assert got["rare_proper_nouns_precision"] == 100.0 and got["rare_proper_nouns_recall"] == 50.0


def test_training_proper_nouns_are_tagged_by_the_tagger_alone():
    """The training-caption pass switches off parser / NER / lemmatiser; the PROPN tokens are the
    ones the full pipeline finds."""
    pytest.importorskip("spacy")
    from tellkit.metrics.ner import analyse, load_nlp, train_proper_nouns

    caps = ["Mayor Jane Doe cuts the ribbon in Albany on Monday.", "Serena Williams at Wimbledon in London.",
            "A protester outside the Capitol in Washington, D.C.", "the bridge at dusk"]
    nlp = load_nlp("auto")
    full = {w for _, props in analyse(caps, nlp) for w in props}
    assert train_proper_nouns(caps, nlp=nlp) == full and {"Jane", "Albany", "Wimbledon"} <= full
    assert "ner" in nlp.pipe_names  # switched off only for that pass


def test_ner_model_is_the_best_installed_and_named():
    pytest.importorskip("spacy")
    import spacy

    from tellkit.metrics.ner import PREFERRED, resolve_model

    installed = set(spacy.util.get_installed_models())
    best = next(m for m in PREFERRED if m in installed)
    assert resolve_model("auto") == resolve_model(None) == best and resolve_model("xx_custom") == "xx_custom"
    got = entity_scores({"a": "Barack Obama visited Paris."}, {"a": "Barack Obama visited Paris."}, with_model=True)
    assert got["ner_model"] == best and got["entities_recall"] == 100.0
    with pytest.raises(TellkitError, match="not installed"):
        entity_scores({"a": "x"}, {"a": "x"}, model="xx_no_such_pipeline")


def test_rouge_l_keeps_the_reference_whitespace():
    # "Doe - left" loses the dash and keeps both spaces: tokens [Jane, Doe, "", left] against
    # [Jane, Doe, left]: LCS 3, P = 3/4, R = 1, F(beta 1.2) = 2.44 P R / (R + 1.44 P)
    pred, refs = {"a": "Jane Doe - left"}, {"a": ["Jane Doe left"]}
    p, r, b2 = 0.75, 1.0, 1.2 ** 2
    expected = 100 * (1 + b2) * p * r / (r + b2 * p)
    assert score_captions(pred, refs, metrics=["rouge"])["rouge_l"] == pytest.approx(expected)
    collapsed = score_captions(pred, refs, metrics=["rouge"], rouge_whitespace="collapsed")
    assert collapsed["rouge_l"] == pytest.approx(100.0)
    # BLEU / CIDEr split on any whitespace: the empty token does not exist for them
    assert score_captions(pred, refs, metrics=["bleu"])["bleu1"] == pytest.approx(100.0)
    with pytest.raises(TellkitError, match="rouge_whitespace"):
        score_captions(pred, refs, metrics=["rouge"], rouge_whitespace="nope")
