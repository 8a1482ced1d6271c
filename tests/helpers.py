"""Small builders shared by the tests: a tiny model, its KV cache and an executor, through the Workbench."""

from gmtool.core.compositions import parse_composition
from gmtool.config import SweepConfig
from gmtool.modes import GraphMode
from gmtool.measure.workbench import Workbench


def graph_mode(mode: str, wide_key: bool) -> GraphMode:
    """The executor tests name a mode and a key width; full graphs come in both widths."""
    if mode == "full":
        return GraphMode.FULL if wide_key else GraphMode.FULL_NARROW
    return GraphMode(mode)


class Rig:
    def __init__(
        self,
        model="tiny-qwen3",
        buckets=(4, 8, 16, 32),
        mode="full",
        wide_key=False,
        max_kv_len=160,
        max_num_seqs=32,
        piecewise_impl="breakable",
    ):
        mode = graph_mode(mode, wide_key)
        cfg = SweepConfig(
            model=model,
            device="cpu",
            dtype="fp32",
            buckets=",".join(map(str, buckets)),
            modes=(GraphMode.EAGER, mode),
            max_kv_len=max_kv_len,
            max_num_seqs=max_num_seqs,
            piecewise_impl=piecewise_impl,
        )
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


def against_transformers(spec: str, prompt: int = 40, also=None):
    """gmtool's paged attention against transformers' own eager attention and masks: the last token's logits of one
    prompt (40 tokens: past every tiny window) through each, as (gmtool's, transformers'). Eager-versus-graph
    checks cannot see a difference here: both of their sides use gmtool's attention. also(rig, batch): more
    checks on the same model."""
    import torch

    rig = Rig(model=spec, buckets=(64,), max_kv_len=64)
    batch = rig.batch(str(prompt))
    if also is not None:
        also(rig, batch)
    ours = rig.eager(batch)[0]
    hf = rig.lm.model
    hf.config._attn_implementation = "eager"
    try:
        theirs = hf(input_ids=torch.as_tensor(batch.input_ids)[None], use_cache=False).logits[0, -1]
    finally:
        hf.config._attn_implementation = "gmtool"
    return ours, theirs


def rel(a, b):
    from gmtool.measure.timing import rel_err_per_seq

    return rel_err_per_seq(a, b)


def md_table_rows(markdown: str, section: str) -> list[list[str]]:
    """The data rows of one Markdown report section's table, as cell strings (header and rule left out)."""
    body = markdown.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines[2:]]


def html_table_rows(html: str, section: str) -> list[list[str]]:
    """The data rows of one HTML report section's table, as (unescaped) cell texts."""
    import re
    from html import unescape

    table = html.split(f"<h2>{section}</h2>", 1)[1].split("</table>", 1)[0]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in table.split("<tr>")[1:]]
    return [[unescape(c) for c in row] for row in rows if row]
