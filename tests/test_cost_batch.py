"""estimate_batch() gives exactly what estimate() gives, candidate by candidate."""
import numpy as np
import pytest

from plan3d.cost.batch import Candidates, estimate_batch
from plan3d.cost.estimate import estimate
from plan3d.layout import Layout, layout_problems
from plan3d.specs.catalog import load_cluster, load_model
from plan3d.specs.training import TrainingSpec
from plan3d.vocab import RECOMPUTE_CODES, RECOMPUTE_MODES

ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "dp-cp-ep-tp-pp")
KEYS = {"step_time_s": "step_time_s", "tokens_per_s": "tokens_per_s", "peak_memory_bytes": "peak_memory_bytes",
        "mfu": "mfu", "model_tflops_per_gpu": "model_tflops_per_gpu", "bubble_fraction": "bubble_fraction"}


def random_layouts(model, training, world, rng, count):
    out = []
    while len(out) < count:
        tp, pp, mb = (int(rng.choice(v)) for v in ([1, 2, 4, 8, 16], [1, 2, 3, 4, 8], [1, 2, 4]))
        if world % (tp * pp):
            continue
        dp = world // (tp * pp) // int(rng.choice([1, 2]))
        layout = Layout(tp=tp, pp=pp, dp=max(dp, 1), micro_batch=mb, vpp=int(rng.choice([1, 2])) if pp > 1 else 1,
                        zero=int(rng.integers(0, 4)), recompute=RECOMPUTE_MODES[rng.integers(0, 3)],
                        sequence_parallel=bool(rng.integers(0, 2)) and tp > 1, order=ORDERS[rng.integers(0, 3)])
        if not layout_problems(layout, model, training, world):
            out.append(layout)
    return out


def candidates(layouts):
    col = lambda f: np.array([f(l) for l in layouts])  # noqa: E731
    return Candidates(col(lambda l: l.tp), col(lambda l: l.pp), col(lambda l: l.dp), col(lambda l: l.micro_batch),
                      col(lambda l: l.vpp), col(lambda l: l.zero), col(lambda l: RECOMPUTE_CODES[l.recompute]),
                      col(lambda l: l.sequence_parallel), col(lambda l: ORDERS.index(l.order)))


@pytest.mark.parametrize("cluster_name,model_name,batch", [("dgx-a100-80g", "gpt3-175b", 1536),
                                                           ("gb200-nvl72", "llama3-70b", 1024),
                                                           ("vtrain-a100", "gpt-neox-20b", 768)])
def test_batch_equals_scalar(cluster_name, model_name, batch):
    nodes = 36 if cluster_name == "gb200-nvl72" else 4
    cluster, model = load_cluster(cluster_name, nodes=nodes), load_model(model_name)
    training = TrainingSpec(global_batch=batch)
    layouts = random_layouts(model, training, cluster.world_size, np.random.default_rng(7), 60)
    result = estimate_batch(cluster, model, training, candidates(layouts), ORDERS)
    for i, layout in enumerate(layouts):
        est = estimate(cluster, model, training, layout)
        for batch_key, scalar_key in KEYS.items():
            assert result[batch_key][i] == pytest.approx(getattr(est, scalar_key), rel=1e-9), (layout, batch_key)
        assert bool(result["fits"][i]) == est.fits
        for key in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm"):
            assert result[f"{key}_s"][i] == pytest.approx(est.time_s[key], rel=1e-9, abs=1e-12), (layout, key)
