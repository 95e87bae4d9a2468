"""The study spec and the one analysis engine on synthetic records with planted effects: the spec is checked at
load (one-line errors, floors, an undecidable plan refused), a 2^k design generates its cells, each contrast
recovers what was planted, the robustness and horizon rules hold, the scorecard fails a predicted "not
separated" that separated, and a study folder is reported under its own name without NaN."""

import gzip
import itertools
import json
import math
import re

import numpy as np
import pytest

from normlab.errors import StudyError
from normlab.paths import REPO_ROOT
from normlab.study import engine, rules
from normlab.study.records import RECORDS
from normlab.study.report import bound_lines, heading, make_report, provenance_lines, scorecard_lines
from normlab.study.spec import StudySpec

ARMS = ("ln_pre", "batchnorm", "rmsnorm", "dyt")
BEST, RUNNER = 0.00316, 0.001
SPEC = """
name: synthetic
test: calibrated
arms: {ln_pre: {config: pre_ln}, batchnorm: {config: batchnorm}, rmsnorm: {config: rmsnorm}, dyt: {config: dyt}}
experiments:
  tune: {lr: [1.0e-3, 3.16e-3], warmup: {on: 5}, seeds: [100, 101]}
  board: {lr: {best_of: tune, ranks: 2}, warmup: {on: 5}, seeds: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}
  aa: {variants: [ln_pre], lr: {best_of: tune}, warmup: {on: 5}, seeds: [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]}
aa: {arm: ln_pre}
hypotheses:
  - {id: H1, claim: "BN is less accurate than LN", outcome: accuracy, a: batchnorm, b: ln_pre, sign: -1, family: F}
  - {id: H2, claim: "RMSNorm matches LN", outcome: accuracy, a: rmsnorm, b: ln_pre, sign: 0, family: F}
  - {id: H3, claim: "DyT's loss is lower", outcome: loss, a: dyt, b: ln_pre, sign: -1, family: F}
  - {id: H4, claim: "per-token norms exit later", outcome: exit, contrast: group_means, a: [ln_pre, rmsnorm],
     b: [batchnorm], sign: 1, family: F}
"""


def spec_file(tmp_path, text=SPEC, name="spec.yaml"):
    (tmp_path / name).write_text(text)
    return tmp_path / name


def synthetic_run(variant, lr, seed, exit_step, acc, experiment="board", steps=416):
    loss = [math.log(2) if s < exit_step else 0.45 for s in range(1, steps + 1)]
    evals = [{"step": s, "accuracy": acc - 0.001 * (steps - s) / 32, "loss": 0.5} for s in range(32, steps + 1, 32)]
    return {"name": f"{variant}-lr{lr:g}-wuon-s{seed}", "experiment": experiment, "experiments": [experiment],
            "variant": variant, "lr": lr, "warmup": "on", "seed": seed, "status": "completed", "commit": "abc1234",
            "machine": "test box", "started_at": "2026-12-01T00:00:00+0000",
            "curves": {"step": list(range(1, steps + 1)), "loss": loss, "eval": evals},
            "scores": {"val/sorted/running": {"accuracy": acc, "loss": 1 - acc}}}


def synthetic_runs(seeds=range(10)) -> list[dict]:
    """BN ahead of LN at the best LR only (H1 depends on the LR); RMSNorm 0.02 ahead of LN everywhere (H2's
    "not separated" fails); DyT leaves the plateau at step ~205 of 416 (its horizon is too short); LN and RMSNorm
    exit ~40 steps after BN (H4)."""
    rng = np.random.default_rng(0)
    runs = []
    for seed in seeds:
        noise = rng.normal(0, 0.003)
        for arm, lr in itertools.product(ARMS, (BEST, RUNNER)):
            acc = 0.72 + noise + rng.normal(0, 0.002) + (0.05 if arm == "batchnorm" and lr == BEST else 0) + \
                (0.02 if arm == "rmsnorm" else 0)
            exit_step = 200 if arm == "dyt" else 60 + (40 if arm in ("ln_pre", "rmsnorm") else 0)
            runs.append(synthetic_run(arm, lr, seed, exit_step + int(rng.integers(0, 12)), acc))
        runs.append(synthetic_run("ln_pre", BEST, seed + 10, 100, 0.72 + rng.normal(0, 0.003), "aa"))
    return runs


SELECTION = {f"tune/{a}/wuon": {"lr": BEST, "runner_up": RUNNER} for a in ARMS}


def analysed(tmp_path, runs, text=SPEC) -> engine.Analysis:
    spec = StudySpec.load(spec_file(tmp_path, text), quiet=True)
    return engine.analyse(engine.Study(runs, SELECTION, spec))


def test_the_engine_finds_the_planted_effects_and_applies_the_robustness_and_horizon_rules(tmp_path):
    a = analysed(tmp_path, synthetic_runs())
    assert a.test == "t" and a.aa["fpr"]["t"] <= 0.05  # the A/A control allowed the t test
    r = {x.h.id: x for x in a.results}
    assert r["H1"].verdicts == {0: "refuted", 1: "not separated"} and r["H1"].verdict == rules.DEPENDS
    assert r["H1"].score == "not shown: depends on the LR"
    assert r["H2"].verdict == "separated (+)" and r["H2"].score == "**FAILED**"  # predicted not separated
    assert r["H3"].horizon == (False, "late exit at the best LRs; late exit at the runner-up LRs")
    assert r["H3"].verdict.endswith("; horizon too short") and r["H3"].score == "no verdict: horizon too short"
    assert r["H4"].verdict == "confirmed" and r["H4"].horizon == (None, "") and r["H4"].score == "held"
    assert r["H4"].est[0].mean == pytest.approx(40.0, abs=8)


def test_too_few_seeds_to_decide_is_said_so_and_a_t_test_has_no_floor(tmp_path):
    """4 seeds, sign-flip, Holm over four: the smallest attainable p is 4 x 2^-3 = 0.5, whatever the data."""
    few = [r for r in synthetic_runs() if r["seed"] < 4]
    a = analysed(tmp_path, few, SPEC.replace("test: calibrated", "test: permutation").replace("aa: {arm: ln_pre}", "")
                 .replace("seeds: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]", "seeds: [0, 1, 2, 3, 4, 5, 6, 7]"))
    h2 = next(r for r in a.results if r.h.id == "H2")
    assert h2.floor == {0: 0.5, 1: 0.5} and h2.verdicts[0] == f"{rules.UNDECIDED} (p >= 0.5)"
    assert h2.score == "undecided"
    assert all(r.floor == {0: 0.0, 1: 0.0} for r in analysed(tmp_path, synthetic_runs()).results)


def test_a_plan_that_cannot_decide_is_refused_at_load_unless_a_pilot(tmp_path, capsys):
    five = SPEC.replace("seeds: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]", "seeds: [0, 1, 2, 3, 4]")
    with pytest.raises(StudyError, match=r"can never reach alpha: H1 \(floor 0.25 with 5 non-zero pairs in a family "
                                         r"of 4\); H2 .* \(or declare `pilot: true`\)"):
        StudySpec.load(spec_file(tmp_path, five))
    StudySpec.load(spec_file(tmp_path, five + "pilot: true\n"))
    assert "H1 0.25" in capsys.readouterr().out
    StudySpec.load(spec_file(tmp_path))
    assert "H1 0.00781" in capsys.readouterr().out  # 4 x 2^-9


@pytest.mark.parametrize("change, words", [
    ("outcome: accuracy, a: batchnorm", "outcome 'accurcy' is not one of accuracy, exit, largest_learning_lr, loss"),
    ("a: batchnorm, b: ln_pre, sign: -1", "arm 'batchnrm' is not an arm of the study"),
    ("sign: -1, family: F}", "hypothesis H1: sign=-2 is not valid"),
    ("contrast: group_means", "contrast='group_mean' is not valid"),
    ("id: H1,", "unknown key 'idd'"),
])
def test_a_bad_hypothesis_is_refused_in_one_line_naming_the_key(tmp_path, change, words):
    bad = {"outcome: accuracy, a: batchnorm": "outcome: accurcy, a: batchnorm",
           "a: batchnorm, b: ln_pre, sign: -1": "a: batchnrm, b: ln_pre, sign: -1",
           "sign: -1, family: F}": "sign: -2, family: F}", "contrast: group_means": "contrast: group_mean",
           "id: H1,": "idd: H1,"}[change]
    with pytest.raises(StudyError) as err:
        StudySpec.load(spec_file(tmp_path, SPEC.replace(change, bad, 1)))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_grids_outcome_is_refused_where_each_run_needs_its_own_value(tmp_path):
    """largest_learning_lr is read off an LR grid per seed, not off a run: an A/A control or a rank correlation on it
    is refused at load in one line, not by a KeyError in the report after the training."""
    spec = SPEC.replace("aa: {arm: ln_pre}", "aa: {arm: ln_pre, outcome: largest_learning_lr}")
    with pytest.raises(StudyError, match=r"aa: outcome 'largest_learning_lr' is not one of accuracy, exit, loss \("):
        StudySpec.load(spec_file(tmp_path, spec))
    ranked = "  - {id: R, outcome: accuracy, contrast: rank_correlation, arms: [ln_pre, batchnorm, rmsnorm, dyt], " \
             "against: largest_learning_lr, role: exploratory}\n"
    with pytest.raises(StudyError, match=r"hypothesis R: against 'largest_learning_lr' is not one of accuracy, exit"):
        StudySpec.load(spec_file(tmp_path, SPEC + ranked))


SPREAD_HOOKS = "hooks: configs/study/hooks/spread.py\n"


@pytest.mark.parametrize("outcome, extra, words", [
    ("spread", "measures: [spread]\n", "measures: 'spread' is not a measure of this study; valid: accuracy, exit, "
                                       "loss (the built-in ones and those its `hooks:` file registers with @measure)"),
    ("spread", "measures: [spread]\nhooks: configs/study/hooks/sprad.py\n",
     f"hooks: {REPO_ROOT}/configs/study/hooks/sprad.py not found"),
    ("spread", "measures: [spred]\n" + SPREAD_HOOKS,
     "measures: 'spred' is not a measure of this study (did you mean 'spread'?); valid: accuracy, exit, loss, spread"),
    ("spred", "measures: [spread]\n" + SPREAD_HOOKS,
     "hypothesis M1: outcome 'spred' is not one of accuracy, exit, largest_learning_lr, loss, spread (did you mean "
     "'spread'?)"),
])
def test_a_measure_nothing_registers_is_refused_at_load_before_a_study_folder_is_written(tmp_path, capsys, outcome,
                                                                                          extra, words):
    """Every measure and outcome a spec names is checked against the built-in measures and those its own hook file
    registers, by study.py's dry run and real run alike, before anything trains (not by the report after)."""
    from normlab.cli import study as runner

    hypothesis = f"  - {{id: M1, outcome: {outcome}, a: batchnorm, b: ln_pre, sign: 1, family: M}}\n"
    path = spec_file(tmp_path, SPEC + hypothesis + extra)
    for dry in (["--dry-run"], []):
        assert runner.main(["--preset", str(path), "--study-dir", str(tmp_path / "st"), *dry]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1
    assert not (tmp_path / "st").exists()


def test_a_measure_name_means_one_function(tmp_path):
    """A hook file loaded again, or its copy in a study folder, registers the same functions again; another
    function under a taken name is refused in one line naming both places."""
    hooks = REPO_ROOT / "configs" / "study" / "hooks" / "spread.py"
    (tmp_path / "copy.py").write_text(hooks.read_text())
    assert engine.load_hooks(hooks) == engine.load_hooks(hooks) == engine.load_hooks(tmp_path / "copy.py") == {"spread"}
    (tmp_path / "other.py").write_text("from normlab.study.engine import measure\n\n"
                                       "measure('spread')(lambda run, study: 0.0)\n")
    with pytest.raises(StudyError) as err:
        engine.load_hooks(tmp_path / "other.py")
    assert str(err.value) == (f"measure 'spread' ({tmp_path / 'other.py'}:3) is already registered by another "
                              f"function ({tmp_path / 'copy.py'}:10); give yours another name")
    with pytest.raises(StudyError, match="^measure 'accuracy' .* is already registered by another function"):
        engine.measure("accuracy")(lambda run, study: 1.0)
    assert engine.load_hooks(hooks) == {"spread"}  # the original is still the one registered


def test_a_hook_file_loads_without_leaving_bytecode_beside_it(tmp_path, monkeypatch):
    """A records folder's hooks.py copy is loaded by every report: no __pycache__ may appear in the folder, where
    report.py writes nothing but the report (and which freezing checks is committed as it is)."""
    import sys

    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # a user's Python (this suite may run without bytecode)
    (tmp_path / "hooks.py").write_text((REPO_ROOT / "configs" / "study" / "hooks" / "spread.py").read_text())
    assert engine.load_hooks(tmp_path / "hooks.py") == {"spread"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hooks.py"] and sys.dont_write_bytecode is False


BOUNDED = SPEC + """
  - {id: B1, outcome: accuracy, a: rmsnorm, b: ln_pre, sign: 1, family: B1, every_run: {a: ">= 0.70", b: "< 0.75"}}
  - {id: B2, outcome: accuracy, a: rmsnorm, b: [ln_pre], contrast: group_means, sign: 1, family: B2,
     every_run: {b: ">= 0.725"}}
"""


def test_a_declared_bound_on_every_run_is_scored_and_one_run_outside_it_fails_the_prediction(tmp_path):
    """RMSNorm is planted 0.02 ahead of LN, every run near 0.72-0.74: B1's bounds hold at both LR ranks, so its
    confirmed sign is held; B2's bound on LN (>= 0.725, a group of one) is broken by some of its runs, so B2 fails
    although its test confirms the sign."""
    a = analysed(tmp_path, synthetic_runs(), BOUNDED)
    r = {x.h.id: x for x in a.results}
    assert r["B1"].verdict == "confirmed" and r["B1"].score == "held"
    assert [row[0::5] for k in (0, 1) for row in r["B1"].bounds[k]] == [("a", True), ("b", True)] * 2
    assert r["B2"].verdict == "confirmed" and r["B2"].score == "**FAILED**: a run outside its declared bound"
    side, bound, lo, hi, n, met = r["B2"].bounds[0][0]
    assert (side, bound, n, met) == ("b", ">= 0.725", 10, False) and lo < 0.725 <= hi
    lines = bound_lines(a)
    assert lines[0] == "## Declared bounds on every run" and sum("**not met**" in x for x in lines) == 2
    assert not bound_lines(analysed(tmp_path, synthetic_runs()))  # no bound declared: no section
    best_only = analysed(tmp_path, [x for x in synthetic_runs() if x["lr"] == BEST], BOUNDED)
    b1 = next(x for x in best_only.results if x.h.id == "B1")  # the runner-up LRs have not trained yet
    assert [row[-1] for row in b1.bounds[1]] == [None, None] and b1.score == "undecided"
    assert sum("| no runs yet |" in x for x in bound_lines(best_only)) == 3 and "nan" not in "".join(lines)


@pytest.mark.parametrize("text, parsed", [(">= 0.55", (">=", 0.55)), (">=0.55", (">=", 0.55)),
                                          (" < 1e-3 ", ("<", 1e-3)), ("> 2", (">", 2.0)),
                                          ("=> 0.5", None), (">= nan", None), ("0.5", None)])
def test_a_bound_is_read_with_or_without_a_space(text, parsed):
    if parsed is None:
        with pytest.raises(ValueError, match="is not a bound; write OP NUMBER"):
            rules.parse_bound(text)
    else:
        assert rules.parse_bound(text) == parsed


@pytest.mark.parametrize("extra, words", [
    ('every_run: {a: "=> 0.5"}', "every_run: a: '=> 0.5' is not a bound; write OP NUMBER, OP one of >=, <=, >, <"),
    ('every_run: {a: ">= half"}', "every_run: a: '>= half' is not a bound"),
    ('every_run: {c: ">= 0.5"}', "every_run: unknown side 'c'; valid sides: a, b"),
    ('ratio: "=> 2"', "ratio: '=> 2' is not a bound; write OP NUMBER"),
    ("within: 0.01", "within is the margin of a predicted tie: it needs sign 0 and a number > 0; got sign 1, "
     "within 0.01"),
])
def test_a_bad_bound_ratio_or_margin_is_refused_in_one_line(tmp_path, extra, words):
    bad = SPEC + f"  - {{id: B, outcome: accuracy, a: rmsnorm, b: ln_pre, sign: 1, {extra}}}\n"
    with pytest.raises(StudyError) as err:
        StudySpec.load(spec_file(tmp_path, bad))
    assert words in str(err.value) and "\n" not in str(err.value)


DECLARED = SPEC + """
  - {id: R1, outcome: accuracy, a: rmsnorm, b: ln_pre, sign: 1, family: R1, ratio: ">= 1.01"}
  - {id: R2, outcome: accuracy, a: rmsnorm, b: ln_pre, sign: 1, family: R2, ratio: ">= 1.5"}
  - {id: W1, outcome: accuracy, a: dyt, b: ln_pre, sign: 0, family: W1, within: 0.01}
  - {id: W2, outcome: accuracy, a: dyt, b: ln_pre, sign: 0, family: W2, within: 0.0005}
"""


def early_dyt(runs):
    """The synthetic runs with DyT leaving the plateau at step 60, so that its horizon holds."""
    out = []
    for r in runs:
        if r["variant"] == "dyt":
            steps = r["curves"]["step"]
            r = {**r, "curves": {**r["curves"], "loss": [math.log(2) if s < 60 else 0.45 for s in steps]}}
        out.append(r)
    return out


def test_a_declared_ratio_and_a_ties_margin_are_scored_and_printed_in_the_scorecard(tmp_path):
    """RMSNorm's accuracy is planted 0.02 over LN's (~0.72): the geometric mean over seeds of their ratio, ~1.03,
    meets ">= 1.01" (R1 held) and not ">= 1.5" (R2 fails although its sign is confirmed). DyT and LN do not
    separate, with an interval of a few thousandths: within +-0.01 the tie holds (W1); within +-0.0005 it is not
    shown (W2)."""
    a = analysed(tmp_path, early_dyt(synthetic_runs()), DECLARED)
    r = {x.h.id: x for x in a.results}
    assert r["R1"].verdict == r["R2"].verdict == "confirmed"
    assert all(1.02 < geo < 1.04 and n == 10 for geo, n, _ in r["R1"].ratios.values())
    assert [met for _, _, met in r["R1"].ratios.values()] == [True, True] and r["R1"].score == "held"
    assert [met for _, _, met in r["R2"].ratios.values()] == [False, False]
    assert r["R2"].score == "**FAILED**: the ratio is not >= 1.5"
    assert r["W1"].verdict == r["W2"].verdict == "not separated" and r["W1"].horizon[0] is True
    assert r["W1"].score == "held" and r["W2"].score == "not shown: the interval is wider than +-0.0005"
    card = "\n".join(scorecard_lines(a))
    assert "| > 0; a / b >= 1.5 (geometric mean over seeds) |" in card
    assert "confirmed; ratio best LRs 1.03 (not met), runner-up LRs 1.03 (not met) |" in card
    assert "| not separated, interval within +-0.01 |" in card
    with pytest.raises(StudyError, match="ratio divides arm a's outcome by arm b's per seed, so it needs contrast "
                                         "pair; got group_means"):
        StudySpec.load(spec_file(tmp_path, SPEC + '  - {id: G, outcome: accuracy, contrast: group_means, a: [dyt], '
                                 'b: [ln_pre], ratio: ">= 2"}\n'))
    best_only = analysed(tmp_path, [x for x in synthetic_runs() if x["lr"] == BEST], DECLARED)
    assert next(x for x in best_only.results if x.h.id == "R1").ratios[1] == (pytest.approx(math.nan, nan_ok=True),
                                                                               0, None)


V7 = {"ln_b32": (32, 0.0, None), "mbn_b32": (32, 0.01, 0.10), "mbn_b32_g8": (32, 0.0, 0.21),
      "ln_b8": (8, 0.0, None), "mbn_b8": (8, -0.02, 0.19)}  # arm: batch, planted accuracy effect, noise


def v7_runs(lr, seed, rng, experiment="runs", arms=V7):
    runs = []
    for arm in arms:
        batch, effect, noise = V7[arm]
        steps = 832 * 32 // batch
        r = synthetic_run(arm, lr, seed, steps // 8, 0.76 + effect + 0.01 * lr * 1e3 + rng.normal(0, 0.002),
                          experiment, steps=steps)
        r["examples_per_step"] = batch
        final = r["scores"]["val/sorted/running"]["accuracy"]  # rising by 0.001 every 1,024 examples to the end
        r["curves"]["eval"] = [{**e, "accuracy": final - 0.001 * (steps - e["step"]) * batch / 1024,
                                **({"stat_noise": noise * (1 + rng.normal(0, 0.05))} if noise else {})}
                               for e in r["curves"]["eval"]]  # the BN arms' evaluations carry the noise
        runs.append(r)
    return runs


def test_the_v7_spec_pairs_every_contrast_at_one_lr_and_reads_the_interaction_across_batch_sizes():
    """configs/study/v7_batch.yaml on synthetic records (accuracy planted: masked BN -0.02 at batch 8, +0.01 at 32,
    the ghost arm as pre-LN; the LR adds the same to every arm): every arm's rank 0 is 1e-3 and rank 1 1.78e-3, so
    both sides of every contrast are runs at one LR; H2 is (mbn_b8 - ln_b8) - (mbn_b32 - ln_b32) = -0.03; the
    horizon pairs batch 8's evaluations with batch 32's by examples; the noise check reads its ratio; the A/A
    reads pre-LN at batch 8 on seeds 10-19."""
    spec = StudySpec.load(REPO_ROOT / "configs" / "study" / "v7_batch.yaml", quiet=True)
    engine.load_hooks(REPO_ROOT / spec.hooks)
    rng = np.random.default_rng(0)
    runs = [r for lr in (1e-3, 1.78e-3) for seed in range(10) for r in v7_runs(lr, seed, rng)]
    runs += [r for seed in range(10, 20) for r in v7_runs(1e-3, seed, rng, "aa", ["ln_b8"])]
    a = engine.analyse(engine.Study(runs, {}, spec))
    for h in spec.hypotheses:
        for k, lr in enumerate((1e-3, 1.78e-3)):
            assert {r.lr for arm in spec.arms_of(h) for r in a.study.arm(arm, k)} <= {lr}, (h.id, k)
    r = {x.h.id: x for x in a.results}
    assert all(r[h].est[k].mean == pytest.approx(-0.03, abs=0.003) for h in ("H2",) for k in (0, 1))
    assert r["H1"].verdict == r["H2"].verdict == "confirmed" and r["H2"].horizon == (True, "")
    assert r["H1"].score == r["H2"].score == "held" and r["H3"].score == "held"
    assert r["N-b8"].score == "held" and all(1.7 < geo < 2.1 for geo, _, _ in r["N-b8"].ratios.values())
    assert a.aa["n"] == (10, 10) and a.study.lr("mbn_b32_g1", 1) == 1.78e-3  # the cut-first arm: no runs, no NaN
    assert r["X-g1"].est[0].n == 0 and "nan" not in "\n".join(scorecard_lines(a)).lower()
    assert heading(a.study, a.test)[0].startswith("5 arms, each at the LRs the spec fixes (0.001 and 0.00178); "
                                                  "832-3328 steps; 10 seeds")


FACTORIAL = """
name: factorial
factors:
  block: {ln: {config: pre_ln}, mbn: {config: masked_batchnorm}}
  final: {ln: {overrides: {model.final_norm: layernorm}}, mbn: {overrides: {model.final_norm: masked_batchnorm}}}
  emb: {off: {}, on: {overrides: {model.embedding_norm: true}}}
experiments:
  tune: {lr: [1.0e-3, 1.78e-3], warmup: {on: 5}, seeds: [100]}
  board: {lr: {best_of: tune, ranks: 2}, warmup: {on: 5}, seeds: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}
hypotheses:
  - {id: final, outcome: exit, contrast: main_effect, factors: [final], sign: -1, family: exit}
  - {id: block, outcome: exit, contrast: main_effect, factors: [block], family: exit}
  - {id: block-final, outcome: exit, contrast: interaction, factors: [block, final], family: exit}
  - {id: emb-final, outcome: exit, contrast: interaction, factors: [emb, final], family: exit}
"""


def planted_exit(levels: dict, seed: int) -> int:
    """100 steps, -50 for a masked-BN final norm in an LN block but only -20 in a masked-BN one (an interaction
    of +30), -10 for an embedding norm, plus a seed's own shift that every cell shares."""
    final = {"ln": -50, "mbn": -20}[levels["block"]] if levels["final"] == "mbn" else 0
    return 100 + final - (10 if levels["emb"] == "on" else 0) + 3 * seed


def test_a_factorial_generates_its_cells_and_each_contrast_recovers_the_planted_effect(tmp_path):
    spec = StudySpec.load(spec_file(tmp_path, FACTORIAL), quiet=True)
    assert list(spec.plan.cells) == [f"{b}_{f}_{e}" for b, f, e in itertools.product(("ln", "mbn"), ("ln", "mbn"),
                                                                                ("off", "on"))]
    cell = spec.plan.experiments["board"].variants["mbn_ln_on"]
    assert cell.config == "configs/masked_batchnorm.yaml"
    assert cell.overrides == {"model.final_norm": "layernorm", "model.embedding_norm": True}
    table = {c: float(planted_exit(levels, 0)) for c, levels in spec.plan.cells.items()}
    got = {k: engine.factorial_contrast(spec.plan.cells, table, f) for k, f in (
        ("block", ["block"]), ("emb", ["emb"]), ("final", ["final"]), ("block x final", ["block", "final"]),
        ("emb x final", ["emb", "final"]), ("all", ["block", "emb", "final"]))}
    assert got == pytest.approx({"block": 15.0, "emb": -10.0, "final": -35.0, "block x final": 30.0,
                                 "emb x final": 0.0, "all": 0.0})
    runs = [synthetic_run(c, lr, seed, planted_exit(levels, seed), 0.75) for seed in range(10)
            for c, levels in spec.plan.cells.items() for lr in (BEST, RUNNER)]
    sel = {f"tune/{c}/wuon": {"lr": BEST, "runner_up": RUNNER} for c in spec.plan.cells}
    r = {x.h.id: x for x in engine.analyse(engine.Study(runs, sel, spec)).results}
    assert r["final"].verdict == "confirmed" and r["block-final"].verdict == "separated (+)"
    # every seed's contrast is exactly 0: no pair differs, so the test could not decide anything
    assert r["emb-final"].verdict.startswith(rules.UNDECIDED) and r["emb-final"].nonzero == {0: 0, 1: 0}


def test_a_factorial_needs_two_levels_a_factor_and_one_config_a_cell(tmp_path):
    with pytest.raises(StudyError, match="factors must map each factor to its two levels"):
        StudySpec.load(spec_file(tmp_path, FACTORIAL.replace("off: {}, on:", "off: {}, half: {}, on:")))
    with pytest.raises(StudyError, match="cell ln_ln_off gets two configs"):
        StudySpec.load(spec_file(tmp_path, FACTORIAL.replace("emb: {off: {}", "emb: {off: {config: dyt}")))
    with pytest.raises(StudyError, match="main_effect names one factor of block, emb, final"):
        StudySpec.load(spec_file(tmp_path, FACTORIAL.replace("factors: [final], sign", "factors: [fnal], sign")))
    with pytest.raises(StudyError, match="every_run bounds the runs of side a or b, so it needs contrast pair or "
                                         "group_means; got main_effect"):
        StudySpec.load(spec_file(tmp_path, FACTORIAL.replace("factors: [final], sign: -1,",
                                                             'factors: [final], sign: -1, every_run: {a: "> 0"},')))


def write_folder(folder, runs, spec_text=SPEC, name="synthetic"):
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / RECORDS, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in runs)
    (folder / "selection.json").write_text(json.dumps(SELECTION))
    (folder / "meta.json").write_text(json.dumps({"name": name, "invocations": []}))
    (folder / "spec.yaml").write_text(spec_text)
    return folder


def test_a_study_folder_is_reported_under_its_own_name_steps_and_seeds_without_nan(tmp_path):
    folder = write_folder(tmp_path / "full", synthetic_runs())
    text = make_report(folder).read_text()
    assert text.startswith("# synthetic: report\n\n4 arms, each at its best and its runner-up LR on dev; "
                           "416 steps; 10 seeds (0, 1, 2, 3, 4, 5, 6, 7, 8, 9).")
    assert "| H2 | claim | RMSNorm matches LN | not separated | separated (+) | **FAILED** |" in text
    assert "nan" not in text.lower() and "Study v" not in text
    assert (folder / "answer.png").stat().st_size > 10_000 and "](answer.png)" in text
    assert "sweep.png" not in text and not (folder / "sweep.png").exists()  # no sweep in these records
    # the same study narrowed to two seeds: its own seeds in the heading, and nothing decided
    narrow = write_folder(tmp_path / "narrow", [r for r in synthetic_runs() if r["seed"] in (0, 1, 10, 11)])
    text = make_report(narrow).read_text()
    assert "; 416 steps; 2 seeds (0, 1)." in text and "nan" not in text.lower()
    assert f"{rules.UNDECIDED} (p >= 1)" in text and "| undecided |" in text


def test_an_unknown_study_or_a_frozen_one_is_refused_in_one_line(tmp_path):
    from normlab.cli import report as report_py

    folder = write_folder(tmp_path / "f", synthetic_runs(range(2)))
    (folder / "spec.yaml").unlink()
    with pytest.raises(StudyError, match="no spec.yaml, the study's spec as it ran"):
        make_report(folder)
    (folder / "spec.yaml").write_text("name: x\nkind: v6\n")
    assert report_py.main([str(folder)]) == 2
    (folder / "meta.json").write_text(json.dumps({"name": "x", "report_commit": "bb37ee6"}))
    with pytest.raises(StudyError, match="regenerates at commit bb37ee6"):
        make_report(folder)
    with pytest.raises(StudyError, match=f"^{re.escape(str(folder))} is a finished study"):  # the source, not --out
        make_report(folder, tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()


def test_provenance_says_what_a_part_trained_study_lacks_and_which_runs_no_invocation_trained(tmp_path):
    spec = StudySpec.load(spec_file(tmp_path), quiet=True)
    runs = synthetic_runs()
    part = [{**r, "status": "pending"} if r["seed"] >= 8 and r["experiment"] == "board" else r for r in runs]
    n = sum(r["status"] == "pending" for r in part)
    lines = provenance_lines(engine.Study(part, SELECTION, spec), {"invocations": []})
    assert lines[1] == "- Invocations: none recorded"
    assert lines[2] == (f"- **Not trained** (the study was stopped before them, or they crashed; left out): {n} of "
                        f"{len(runs)} runs, by seed: 8 ({n // 2}), 9 ({n // 2})")
    late = [{**r, "started_at": "2026-12-01T13:00:00+0000" if r["seed"] >= 8 else "2026-12-01T10:30:00+0000"}
            for r in runs]
    calls = [{"command": "study.py", "commit": "abc1234", "started": "2026-12-01 10:00:00", "wall_s": 3600.0}]
    lines = provenance_lines(engine.Study(late, SELECTION, spec), {"invocations": calls})
    outside = sum(r["seed"] >= 8 for r in runs)
    assert lines[2].startswith(f"- **{outside} of {len(runs)} runs started outside every invocation listed**")


@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO_ROOT / "configs" / "study").glob("*.yaml")))
def test_every_preset_is_a_spec_that_can_decide_or_says_it_is_a_pilot(preset, capsys):
    spec = StudySpec.load(REPO_ROOT / "configs" / "study" / f"{preset}.yaml")
    floors = [t.floor() for t in spec.planned_tests()]
    assert spec.pilot or all(f < spec.alpha for f in floors)
    if spec.hypotheses:
        assert f"study {spec.name}: floors" in capsys.readouterr().out
    if preset == "smoke":
        assert spec.pilot and floors == [1.0, 1.0] and spec.ranks() == 2 and spec.arms() == ["ln_pre", "rmsnorm",
                                                                                             "batchnorm"]
