"""Small builders shared by the tests: a tiny model, its KV cache, an executor."""
import torch

from gmtool.attention import ForwardContext, forward_context
from gmtool.batch import make_batch
from gmtool.buckets import BucketKey, BucketPolicy
from gmtool.compositions import parse_composition
from gmtool.executor import GraphExecutor
from gmtool.inputs import PersistentInputs
from gmtool.kv_cache import KVCacheSpec, PagedKVCache
from gmtool.model import load_model

CPU = torch.device("cpu")


class Rig:
    def __init__(self, model="tiny-qwen3", buckets=(4, 8, 16, 32), mode="full", wide_key=False, max_kv_len=160,
                 max_num_seqs=32):
        self.lm = load_model(model, CPU, torch.float32, seed=0)
        spec = KVCacheSpec(self.lm.num_layers, self.lm.num_kv_heads, self.lm.head_dim, 16, max_kv_len,
                           torch.float32)
        self.cache = PagedKVCache(spec, 400, CPU)
        self.cache.fill_random(0)
        self.max_num_seqs = max_num_seqs
        self.ex = GraphExecutor(self.lm, self.cache, BucketPolicy(list(buckets), wide_key=wide_key), mode,
                                max_num_seqs, CPU)
        self.eager_inputs = PersistentInputs(max(buckets), max_num_seqs, spec.blocks_per_seq,
                                             self.lm.vocab_size, torch.float32, CPU)

    def batch(self, text, seed=0):
        return make_batch(parse_composition(text, seed), self.cache, self.lm.vocab_size, self.max_num_seqs)

    def eager(self, batch):
        """Reference: the exact batch, no padding, no graph."""
        key = BucketKey(batch.num_tokens, batch.num_seqs, batch.is_decode)
        views = self.eager_inputs.load(batch, key)
        ctx = ForwardContext(self.cache, views, "decode" if batch.is_decode else "planned", batch.plan)
        with forward_context(ctx), torch.no_grad():
            return self.lm.forward_logits(views.input_ids, views.positions, views.logits_indices)

    def graph(self, batch):
        return self.ex.step(batch).clone()


def rel(a, b):
    from gmtool.timing import rel_err_per_seq

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
