"""Small builders shared by the tests: a tiny model, its KV cache and an executor, through the Workbench."""
import torch

from gmtool.compositions import parse_composition
from gmtool.config import SweepConfig
from gmtool.modes import GraphMode
from gmtool.workbench import Workbench

CPU = torch.device("cpu")


def graph_mode(mode: str, wide_key: bool) -> GraphMode:
    """The executor tests name a mode and a key width; full graphs come in both widths."""
    if mode == "full":
        return GraphMode.FULL if wide_key else GraphMode.FULL_NARROW
    return GraphMode(mode)


class Rig:
    def __init__(self, model="tiny-qwen3", buckets=(4, 8, 16, 32), mode="full", wide_key=False, max_kv_len=160,
                 max_num_seqs=32, piecewise_impl="breakable"):
        mode = graph_mode(mode, wide_key)
        cfg = SweepConfig(model=model, device="cpu", dtype="fp32", buckets=",".join(map(str, buckets)),
                          modes=(GraphMode.EAGER, mode), max_kv_len=max_kv_len, max_num_seqs=max_num_seqs,
                          piecewise_impl=piecewise_impl)
        self.bench = Workbench.build(cfg, num_blocks=400)
        self.lm, self.cache, self.max_num_seqs = self.bench.lm, self.bench.cache, max_num_seqs
        self.ex = self.bench.executor(mode)
        self.eager_inputs = self.bench.eager_inputs

    def batch(self, text, seed=0):
        return self.bench.batch(parse_composition(text, seed))

    def eager(self, batch):
        """Reference: the exact batch, no padding, no graph."""
        fn, logits = self.bench.eager_fn(batch)
        fn()
        return logits.clone()

    def graph(self, batch):
        return self.ex.step(batch).clone()


def rel(a, b):
    from gmtool.timing import rel_err_per_seq

    return rel_err_per_seq(a, b)
