"""plan3d.vocab: one spelling of the shared words, and every layer keyed by it."""
import ast
import re
import typing
from pathlib import Path

import numpy as np
import pytest

from plan3d import vocab
from plan3d.vocab import (COLLECTIVE_KINDS, MEMORY_TERMS, PHASES, RECOMPUTE_CODES, RECOMPUTE_MODES, RING_COLLECTIVES,
                          TIME_COLUMNS, TIME_TERMS, seconds_column, term_of_column)

ROOT = Path(__file__).resolve().parents[1]


def test_vocab_is_a_leaf_module():
    tree = ast.parse((ROOT / "plan3d" / "vocab.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("plan3d")], imported


def test_every_term_has_a_label_in_the_estimate_tables_and_plots():
    from plan3d.render.estimate import MEMORY_LABELS, TIME_LABELS

    assert tuple(TIME_LABELS) == TIME_TERMS
    assert tuple(MEMORY_LABELS) == MEMORY_TERMS
    assert len(set(TIME_LABELS.values())) == len(TIME_TERMS)  # no two terms read the same


def test_report_and_explain_label_exactly_the_terms_they_show():
    from plan3d.ranking import EXPLAINED_TERMS
    from plan3d.render.recommend import EXPLAIN_ROWS, EXPLAIN_TIME_LABELS, METRICS
    from plan3d.render.report import BREAKDOWN_TERMS, TIME_LABELS

    assert tuple(TIME_LABELS) == BREAKDOWN_TERMS
    assert tuple(EXPLAIN_TIME_LABELS) == EXPLAINED_TERMS
    assert set(BREAKDOWN_TERMS) <= set(TIME_TERMS) and set(EXPLAINED_TERMS) <= set(TIME_TERMS)
    columns = [key for _, key in EXPLAIN_ROWS if term_of_column(key)]
    assert columns == [seconds_column(t) for t in EXPLAINED_TERMS]
    assert [k for k in METRICS if term_of_column(k)] == columns


def test_seconds_columns_round_trip():
    assert TIME_COLUMNS == tuple(f"{t}_s" for t in TIME_TERMS)
    assert [term_of_column(c) for c in TIME_COLUMNS] == list(TIME_TERMS)
    assert term_of_column("step_time_s") is None and term_of_column("compute") is None


def test_estimate_and_batch_produce_every_term(llama_specs):
    from plan3d.cost.batch import Candidates, estimate_batch
    from plan3d.cost.estimate import estimate
    from plan3d.layout import Layout

    cluster, model, training = llama_specs
    est = estimate(cluster, model, training, Layout(tp=2, pp=2, dp=2, recompute="selective"))
    assert tuple(est.time_s) == TIME_TERMS
    assert tuple(est.memory_bytes) == MEMORY_TERMS
    assert est.step_time_s == pytest.approx(sum(est.time_s.values()), rel=1e-12)
    def one(v):
        return np.array([v])
    cands = Candidates(tp=one(2), pp=one(2), dp=one(2), micro_batch=one(1), vpp=one(1), zero=one(0),
                       recompute=one(RECOMPUTE_CODES["selective"]), sequence_parallel=one(False), order=one(0))
    batch = estimate_batch(cluster, model, training, cands, ("tp-cp-ep-dp-pp",))
    for term in TIME_TERMS:
        assert float(batch[seconds_column(term)][0]) == pytest.approx(est.time_s[term], rel=1e-9), term


@pytest.fixture
def llama_specs():
    from plan3d.cli.common import load_specs

    return load_specs("dgx-h100", "llama3-8b", 1, None, None, None)


def test_recompute_codes_follow_the_modes_and_the_schemas_list_the_same_modes():
    from plan3d.layout import Recompute
    from plan3d.specs.engine import Recompute as EngineRecompute

    assert [RECOMPUTE_CODES[m] for m in RECOMPUTE_MODES] == list(range(len(RECOMPUTE_MODES)))
    assert RECOMPUTE_MODES[-1] == "full"  # `>= full` reads full: nothing ranks above it
    assert RECOMPUTE_CODES["full"] > RECOMPUTE_CODES["moe-act"] > RECOMPUTE_CODES["selective"] > RECOMPUTE_CODES["none"]
    assert typing.get_args(Recompute) == RECOMPUTE_MODES
    assert typing.get_args(EngineRecompute) == RECOMPUTE_MODES


def test_collective_kinds_are_what_specs_accept_and_the_cost_model_prices():
    from plan3d.cost.comm import COST_OF, RING_TERMS
    from plan3d.specs.cluster import CollectiveOp

    assert typing.get_args(CollectiveOp) == COLLECTIVE_KINDS
    assert tuple(RING_TERMS) == COLLECTIVE_KINDS
    assert tuple(COST_OF) == RING_COLLECTIVES
    assert set(RING_COLLECTIVES) < set(COLLECTIVE_KINDS)


def test_each_phase_and_each_time_term_is_paired_once():
    from plan3d.run.compare import PHASE_PAIRS

    measured = [k for _, keys, _ in PHASE_PAIRS for k in keys]
    predicted = [k for _, _, keys in PHASE_PAIRS for k in keys]
    assert measured == list(PHASES)
    assert sorted(predicted) == sorted(TIME_TERMS)


def test_the_runtime_marks_the_phases_in_order():
    """runtime/train.py's PhaseClock marks (read as text: this tier does not import torch)."""
    source = (ROOT / "plan3d" / "runtime" / "train.py").read_text()
    assert tuple(re.findall(r'clock\.mark\("(\w+)"\)', source)) == PHASES


def test_no_module_spells_the_time_terms_again():
    """The `_s` column names of the time terms appear only as seconds_column() of the vocabulary."""
    words = [c for c in TIME_COLUMNS if c not in ("optimizer_s", "overhead_s")]  # also suffixes of spec knobs
    spelled = []
    for path in (ROOT / "plan3d").rglob("*.py"):
        text = path.read_text()
        if any(f'"{c}"' in text for c in words):
            spelled.append(str(path.relative_to(ROOT)))
    assert spelled == [], spelled


def test_vocab_names_are_tuples():
    for name in ("TIME_TERMS", "COMM_TERMS", "PER_MICRO_BATCH_TERMS", "MEMORY_TERMS", "MODEL_STATE_TERMS", "PHASES",
                 "RECOMPUTE_MODES", "COLLECTIVE_KINDS", "RING_COLLECTIVES"):
        value = getattr(vocab, name)
        assert isinstance(value, tuple) and len(set(value)) == len(value), name
    assert set(vocab.COMM_TERMS) < set(TIME_TERMS) and set(vocab.PER_MICRO_BATCH_TERMS) < set(TIME_TERMS)
    assert set(vocab.MODEL_STATE_TERMS) < set(MEMORY_TERMS)
