"""Every bad input of issue 13 (and its neighbours), each through the real entry point: exit 2, one line on
stderr, no traceback, no error on stdout, and no output directory left behind. CASES is also what
tools/bad_inputs.py runs to print the bad-input table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gmtool.errors import GmtoolError
from tests.test_compare import run_cli

ROOT = Path(__file__).resolve().parents[1]
CPU = ["--device", "cpu"]

# (case, argv with {tmp} for the case's directory, what the one line must say); every capture/compare/memreport
# case writes to {tmp}/o, which must not exist afterwards
CASES = [
    ("--model a file that is not JSON", ["capture", *CPU, "--model", "{tmp}/invalid.json"], "cannot read config file"),
    (
        "--model a config that is not a causal LM",
        ["capture", *CPU, "--model", "{tmp}/t5.json"],
        "is not a causal language model",
    ),
    (
        "--model an unknown model_type",
        ["capture", *CPU, "--model", "{tmp}/unknown.json"],
        "does not know model_type 'no-such-type'",
    ),
    (
        "--model a config with a field of the wrong type",
        ["capture", *CPU, "--model", "{tmp}/badfield.json"],
        "the qwen3 config is invalid: Validation error for field 'hidden_size'",
    ),
    ("--model an unknown name", ["capture", *CPU, "--model", "no-such-model"], "unknown model 'no-such-model':"),
    ("--model a misspelt name", ["capture", *CPU, "--model", "Qwen3-06b"], "(did you mean qwen3-0.6b?)"),
    ("--model a bucket named twice", ["capture", *CPU, "--buckets", "1,2,1"], "bucket 1 is given twice in '1,2,1'"),
    (
        "learned positions fewer than --max-kv-len",
        ["capture", *CPU, "--model", "{tmp}/gpt2pos16.json", "--out", "{tmp}/o"],
        "its learned position embeddings (transformer.wpe) hold 16 positions, and --max-kv-len 128 reaches past them",
    ),
    # the one line is printed as written: rich would read [/b] as a closing tag (a traceback) and drop [red]
    ("an error quoting rich markup", ["capture", *CPU, "--buckets", "1,[/b]"], "malformed bucket item '[/b]'"),
    ("--model a path with brackets", ["capture", *CPU, "--model", "{tmp}/[red]x"], "[red]x: no such checkpoint folder"),
    (
        "--model a path that is not there",
        ["capture", *CPU, "--model", "/no/such/dir"],
        "--model /no/such/dir: no such checkpoint folder or config.json",
    ),
    (
        "--model a checkpoint with corrupt safetensors",
        ["capture", *CPU, "--model", "{tmp}/corrupt"],
        "cannot read weight file",
    ),
    (
        "--model a checkpoint of shards without their index",
        ["capture", *CPU, "--model", "{tmp}/shards"],
        "holds model-00001-of-00002.safetensors and 1 more but no model.safetensors or pytorch_model.bin",
    ),
    ("--out under a file", ["capture", *CPU, "--out", "{tmp}/afile/run"], "cannot create output directory"),
    (
        "--out a directory that cannot be written",
        ["capture", *CPU, "--out", "/proc/self/fd", "--force"],
        "cannot write into output directory",
    ),
    ("capture --mode eager", ["capture", *CPU, "--mode", "eager"], "--mode 'eager' captures nothing"),
    ("capture --mode unknown", ["capture", *CPU, "--mode", "fastest"], "is an unknown mode"),
    ("--compositions ''", ["capture", *CPU, "--compositions", ""], "empty composition list"),
    ("--buckets ''", ["capture", *CPU, "--buckets", ""], "empty bucket list"),
    ("--buckets malformed", ["capture", *CPU, "--buckets", "8,a"], "malformed bucket item"),
    ("--num-iters-warmup -3", ["capture", *CPU, "--num-iters-warmup", "-3"], "--num-iters-warmup must be 0 or more"),
    ("--kv-cache-gb -1", ["capture", *CPU, "--kv-cache-gb", "-1"], "--kv-cache-gb must be positive"),
    (
        "--max-num-seqs below a composition",
        ["capture", *CPU, "--buckets", "4", "--compositions", "1*4", "--max-num-seqs", "2"],
        "above --max-num-seqs 2",
    ),
    ("--scenario unknown", ["capture", *CPU, "--scenario", "sideways"], "is not one of"),
    ("--dtype unknown", ["capture", *CPU, "--dtype", "int3"], "unknown dtype"),
    ("--compile on the CPU", ["capture", *CPU, "--compile"], "--compile"),
    ("--small-m-gemm without --fuse", ["compare", *CPU, "--small-m-gemm"], "needs fuse (--fuse) as well"),
    ("--pdl without --small-m-gemm", ["compare", *CPU, "--fuse", "--pdl"], "needs small_m_gemm (--small-m-gemm)"),
    ("--format unknown", ["capture", *CPU, "--format", "yaml"], "'yaml' is not one of 'human', 'json', 'quiet'"),
    ("--compositions 1@10000000", ["capture", *CPU, "--compositions", "1@10000000"], "--max-kv-len"),
    ("--max-kv-len 100000000", ["capture", *CPU, "--max-kv-len", "100000000"], "--max-kv-len"),
    (
        "--buckets 1:100000:1",
        ["capture", *CPU, "--buckets", "1:100000:1", "--max-num-seqs", "100000"],
        "holds 100,000 sizes: at most 4,096",
    ),
    (
        "--max-tokens below the largest bucket",
        ["capture", *CPU, "--buckets", "1,8", "--max-tokens", "4"],
        "--max-tokens 4 is below bucket 8",
    ),
    ("--max-tokens 0", ["capture", *CPU, "--max-tokens", "0"], "--max-tokens must be positive"),
    ("compare hf-compiled on the CPU", ["compare", "eager,hf-compiled", *CPU], "needs CUDA"),
    ("compare an unknown mode", ["compare", "eager,fast", *CPU], "unknown mode 'fast'"),
    (
        "compare --baseline of another scenario",
        ["compare", "eager", *CPU, "--baseline", "{tmp}/prefill.json"],
        "is a prefill run, this run is decode",
    ),
    (
        "compare --baseline that is not JSON",
        ["compare", "eager", *CPU, "--baseline", "{tmp}/invalid.json"],
        "cannot read results file",
    ),
    ("memreport on the CPU", ["memreport", *CPU], "memory strategies need CUDA"),
    ("memreport --mode eager", ["memreport", *CPU, "--mode", "eager"], "--mode must be one of full, piecewise, auto"),
    ("report on a results.json missing keys", ["report", "{tmp}/incomplete"], "record 1 lacks composition, status"),
    ("report on a results.json without a model", ["report", "{tmp}/nomodel"], "no 'model' section"),
    ("report on a directory without results", ["report", "{tmp}/empty"], "no results file"),
    ("report on a journal cut short in its first line", ["report", "{tmp}/cut"], "one line, cut short"),
    (
        "plan an unknown workload",
        ["plan", "--workload", "no-such-workload", "--from", "{tmp}/incomplete"],
        "no-such-workload",
    ),
    (
        "plan --memory-budget 0",
        ["plan", "--workload", "chat", "--memory-budget", "0"],
        "--memory-budget must be positive",
    ),
    ("verify --modes eager", ["verify", *CPU, "--modes", "eager"], "is not a graph mode"),
    pytest.param(
        "bench without CUDA",
        ["bench"],
        "needs CUDA",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="bench runs where there is CUDA"),
    ),
    ("verify --steps 0", ["verify", *CPU, "--steps", "0"], "must be positive"),
    # before anything runs, with or without CUDA: a typo at the end must not cost the stages before it
    ("bench --stages with a typo", ["bench", "--stages", "decode,decode-abb"], "unknown stage 'decode-abb'"),
    # the hunt of issue badinput: each of these was a traceback, or was run (or dropped) silently
    ("--compositions with an empty item", ["capture", *CPU, "--compositions", "1,,2"], "malformed composition list"),
    ("--max-kv-len 1 (a decode reads a cached token)", ["capture", *CPU, "--max-kv-len", "1"], "at least one cached"),
    ("--kv-cache-gb inf", ["capture", *CPU, "--kv-cache-gb", "inf"], "--kv-cache-gb must be positive and at most"),
    ("--seed beyond torch's range", ["capture", *CPU, "--seed", "99999999999999999999"], "--seed must be between"),
    ("--dtype ''", ["capture", *CPU, "--dtype", ""], "unknown dtype ''"),
    ("--tp-timeout 0", ["capture", *CPU, "--tp-timeout", "0"], "--tp-timeout must be 1 to 604,800 seconds"),
    ("--tp-timeout without --tp", ["capture", *CPU, "--tp-timeout", "30"], "--tp-timeout applies to ranks waiting"),
    ("--device cuda:x", ["capture", "--device", "cuda:x"], "unknown device 'cuda:x'"),
    (
        "a decode bucket above --max-num-seqs",
        ["capture", *CPU, "--buckets", "8", "--max-num-seqs", "4"],
        "runs on bucket 8, above --max-num-seqs 4",
    ),
    ("compare ''", ["compare", "", *CPU], "no mode given"),
    # found by a review's sweep (2026-12-02): tracebacks, a run that never ended, and requests silently dropped
    ("--buckets a range of ten billion", ["capture", *CPU, "--buckets", "1:10000000000"], "at most 4,096"),
    ("plan --candidates a huge range", ["plan", *CPU, "-w", "chat", "--candidates", "1:100000000"], "at most 4,096"),
    ("--kv-cache-gb 1e308", ["capture", *CPU, "--kv-cache-gb", "1e308"], "--kv-cache-gb must be positive and at most"),
    ("--model model_type a list", ["capture", *CPU, "--model", "{tmp}/mtlist.json"], "model_type must be a string"),
    ("--model vocab_size 0", ["capture", *CPU, "--model", "{tmp}/vocab0.json"], "vocab_size must be positive, got 0"),
    ("--model no layers", ["capture", *CPU, "--model", "{tmp}/layers0.json"], "num_hidden_layers must be positive"),
    ("--model a profile file", ["capture", *CPU, "--model", "{tmp}/profile.json"], "looks like a gmtool model profile"),
    ("--model ''", ["capture", *CPU, "--model", ""], "--model is empty"),
    ("--model a .bin holding a list", ["capture", *CPU, "--model", "{tmp}/binlist"], "not a state dict"),
    ("--model a .bin of a non-tensor", ["capture", *CPU, "--model", "{tmp}/binint"], "is not a tensor (int)"),
    ("--model an index naming no file", ["capture", *CPU, "--model", "{tmp}/idxint"], "is not a weight index"),
    ("plan a workload count of inf", ["plan", *CPU, "-w", "{tmp}/inf.csv"], "must be a whole number below 2**62"),
    # found by a review's sweep (2026-12-05): a traceback from a size numpy wraps around; a refusal naming a
    # composition verify takes no option for
    # a million layers: the memory estimate built them on the meta device for minutes before refusing
    ("--model a million layers", ["capture", *CPU, "--model", "{tmp}/layershuge.json"], "this run needs about"),
    ("plan --max-tokens 0", ["plan", *CPU, "-w", "chat", "--max-tokens", "0"], "--max-tokens must be positive, got 0"),
    ("verify --max-num-seqs 1", ["verify", *CPU, "--max-num-seqs", "1"], "--max-num-seqs 1: verify needs 2 or more"),
    (
        "plan --candidates above int64",
        ["plan", *CPU, "-w", "chat", "--candidates", "99999999999999999999"],
        "size 99999999999999999999 is not a token count from 1 to 2,147,483,647",
    ),
    ("compare a stray comma", ["compare", "eager,,full", *CPU], "has an empty item"),
    ("compare a trailing comma", ["compare", "eager,full,", *CPU], "has an empty item"),
    ("verify --modes a stray comma", ["verify", *CPU, "--modes", "full,,piecewise"], "has an empty item"),
    ("verify --strategy a stray comma", ["verify", *CPU, "--strategy", "default,,default"], "has an empty item"),
    ("verify --buckets ''", ["verify", *CPU, "--buckets", ""], "empty bucket list"),
    ("compare a profile of no modes", ["compare", *CPU, "--profile", "{tmp}/nomodes.json"], "no mode given"),
    (
        "compare --peer-buckets without hf-compiled",
        ["compare", "eager,full", *CPU, "--buckets", "1,2", "--peer-buckets", "1"],
        "--peer-buckets applies to hf-compiled",
    ),
    (
        "compare --peer-compile without hf-compiled",
        ["compare", "eager,full", *CPU, "--peer-compile", "per-bucket"],
        "--peer-compile applies to hf-compiled",
    ),
    ("verify --check-every above --steps", ["verify", *CPU, "--steps", "5"], "no step would be checked"),
    ("verify --inject ''", ["verify", *CPU, "--inject", ""], "unknown --inject ''"),
    (
        "verify: decodes of --max-num-seqs above it",
        ["verify", *CPU, "--buckets", "1,2,8", "--max-num-seqs", "4"],
        "would run on bucket 8",
    ),
    (
        "plan --from with a measuring option",
        ["plan", "--workload", "chat", "--from", "{tmp}/incomplete", "--buckets", "1,2"],
        "--buckets sets how costs are measured",
    ),
    ("report on a results.json lacking what it shows", ["report", "{tmp}/prefill.json"], "'model' section lacks"),
    ("bench --iters 0", ["bench", "--iters", "0"], "--iters must be between 1 and 100,000, got 0"),
    ("--num-iters past the bound", ["capture", *CPU, "--num-iters", "100001"], "--num-iters must be at most 100,000"),
    (
        "--num-iters-warmup past it",
        ["compare", *CPU, "--num-iters-warmup", "10000000"],
        "--num-iters-warmup must be at most",
    ),
    (
        "--kv-cache-gb too small for a block, refused before the load",
        ["capture", *CPU, "--kv-cache-gb", "1e-300"],
        "--kv-cache-gb 1e-300 cannot hold two KV blocks of this model",
    ),
    (
        "verify --steps past it",
        ["verify", *CPU, "--steps", "1000000"],
        "--steps must be at most 100,000, got 1,000,000",
    ),
    ("--piecewise-impl fx without a piecewise mode", ["capture", *CPU, "--piecewise-impl", "fx"], "this run has none"),
    # click keeps the last of a repeated option and drops the first without a word
    (
        "--buckets given twice",
        ["capture", *CPU, "--buckets", "1,2", "-b", "4,8"],
        "--buckets given 2 times ('1,2' then '4,8')",
    ),
    (
        "--fuse and --no-fuse",
        ["compare", *CPU, "--fuse", "--no-fuse"],
        "--fuse given 2 times ('--fuse' then '--no-fuse')",
    ),
    (
        "--workload given twice, one with =",
        ["plan", "--workload=chat", "--workload", "bursty"],
        "--workload given 2 times ('chat' then 'bursty')",
    ),
    ("a capture profile of eager alone", ["capture", *CPU, "--profile", "{tmp}/eager.json"], "capture nothing"),
    (
        "--piecewise-impl fx where auto serves only decode steps",
        ["capture", *CPU, "--mode", "auto", "--piecewise-impl", "fx", "--buckets", "1,2"],
        "auto serves every batch of this run with full graphs",
    ),
    (
        "a workload row with more fields than its header",
        ["plan", "--workload", "{tmp}/toomany.csv", "--from", "{tmp}/o"],
        "its rows have more fields than its header",
    ),
    ("a misspelt workload column", ["plan", "--workload", "{tmp}/typo.csv"], "unknown column 'counts'"),
    ("a sweep profile that is not UTF-8", ["capture", *CPU, "--profile", "{tmp}/latin.json"], "is not UTF-8 text"),
    (  # was "composition 8*2: ...", a mix the user never gave
        "a default mix longer than --max-kv-len",
        ["capture", *CPU, "--scenario", "prefill", "--buckets", "16", "--max-kv-len", "3"],
        "bucket 16's default prefill mix 8*2: prefix + new tokens = 8 exceeds --max-kv-len 3: raise --max-kv-len to 8 "
        "or give --compositions",
    ),
    (
        "capture given a list of modes",
        ["capture", *CPU, "--mode", "full,piecewise"],
        "--mode 'full,piecewise': capture runs one graph mode; compare takes a list (gmtool compare eager,full,piecewise)",
    ),
    (  # was "unknown sweep profile": a file name is no built-in name
        "a sweep profile file that is not there",
        ["capture", *CPU, "--profile", "gone.json"],
        "no sweep profile file 'gone.json' (built-in profiles: ",
    ),
    (
        "verify's output-sharing fault on piecewise graphs alone",
        ["verify", *CPU, "--modes", "piecewise", "--inject", "share-output-across-buckets"],
        "it is modeled on full graphs",
    ),
    (  # the default modes, full and piecewise: refused once piecewise's soak started, full's finding lost
        "verify's output-sharing fault where one of the modes is piecewise",
        ["verify", *CPU, "--inject", "share-output-across-buckets"],
        "give --modes without piecewise: full, full-narrow or auto",
    ),
]

CAPTURE_LIKE = ("capture", "compare", "memreport", "plan", "verify")


def make_inputs(tmp: Path) -> None:
    """The files the cases name, in tmp."""
    (tmp / "invalid.json").write_text("{bad")
    (tmp / "t5.json").write_text(
        '{"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 2, '
        '"d_kv": 16, "d_ff": 64, "vocab_size": 100}'
    )
    (tmp / "unknown.json").write_text('{"model_type": "no-such-type"}')
    (tmp / "badfield.json").write_text('{"model_type": "qwen3", "hidden_size": "big"}')
    (tmp / "afile").write_text("x")
    corrupt = tmp / "corrupt"
    corrupt.mkdir()
    config = json.loads((ROOT / "profiles/models/tiny-qwen3.json").read_text())["config"]
    (corrupt / "config.json").write_text(json.dumps(config))
    (corrupt / "model.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": 1}')
    shards = tmp / "shards"  # the index not downloaded: the run would have had random weights
    shards.mkdir()
    (shards / "config.json").write_text(json.dumps(config))
    for i in (1, 2):
        (shards / f"model-0000{i}-of-00002.safetensors").write_bytes(b"")
    doc = {
        "tool": "gmtool",
        "schema_version": 1,
        "command": "compare",
        "model": {"name": "tiny-qwen3"},
        "config": {"scenario": "prefill", "modes": ["eager"]},
        "machine": {"device": "cpu"},
        "errors": [],
        "notes": [],
        "records": [],
    }
    (tmp / "prefill.json").write_text(json.dumps(doc))
    for name, over in (("incomplete", {"records": [{"mode": "full", "bucket": 1}]}), ("nomodel", {"model": None})):
        (tmp / name).mkdir()
        (tmp / name / "results.json").write_text(json.dumps({**doc, **over}))
    (tmp / "empty").mkdir()
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 16}
    (tmp / "gpt2pos16.json").write_text(json.dumps(gpt2 | {"bos_token_id": 0, "eos_token_id": 0}))
    (tmp / "mtlist.json").write_text(json.dumps({**config, "model_type": ["qwen3"]}))
    (tmp / "vocab0.json").write_text(json.dumps({**config, "vocab_size": 0}))
    (tmp / "layers0.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    (tmp / "layershuge.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    (tmp / "profile.json").write_text((ROOT / "profiles/models/tiny-qwen3.json").read_text())
    for name, stored in (("binlist", [1, 2]), ("binint", {"model.embed_tokens.weight": 5})):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
        torch.save(stored, tmp / name / "pytorch_model.bin")
    (tmp / "idxint").mkdir()
    (tmp / "idxint" / "config.json").write_text(json.dumps(config))
    (tmp / "idxint" / "model.safetensors.index.json").write_text('{"weight_map": {"a": 5}}')
    (tmp / "inf.csv").write_text("num_tokens,num_seqs,count\n1,1,inf\n")
    (tmp / "nomodes.json").write_text('{"modes": []}')
    (tmp / "eager.json").write_text('{"modes": ["eager"], "buckets": "1,2"}')
    (tmp / "toomany.csv").write_text("num_tokens,num_seqs\n4,2,7,9\n")
    (tmp / "typo.csv").write_text("num_tokens,num_seqs,counts\n4,2,1000\n600,1,1\n")
    (tmp / "latin.json").write_bytes(b'{"buckets": "1,2", "description": "\xff\xfe"}')
    (tmp / "cut").mkdir()
    (tmp / "cut" / "records.jsonl").write_text('{"tool": "gmtool", "sche')  # killed while writing its header


def argv_of(case_argv: list[str], tmp: Path) -> list[str]:
    argv = [a.replace("{tmp}", str(tmp)) for a in case_argv]
    if argv[0] in CAPTURE_LIKE and "--out" not in argv:
        argv += ["--out", str(tmp / "o")]
    return argv


@pytest.mark.parametrize(
    "case, args, message", CASES, ids=[(c.values if hasattr(c, "values") else c)[0] for c in CASES]
)
def test_every_bad_input_is_one_line_and_exit_2(tmp_path, case, args, message):
    make_inputs(tmp_path)
    code, stdout, stderr = run_cli(*argv_of(args, tmp_path))
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    assert message in lines[0] and len(lines[0]) < 300, lines[0]
    assert "error" not in stdout and "Traceback" not in stdout  # stdout: at most the run's notes
    assert not (tmp_path / "o").exists()


# inputs that failed though the run is a fair request: the capturability probe's batches were larger than the
# run's buffers (a 3-token prefill over buckets 1,2; verify's 5-token one over buckets 1,2), tracebacks both
RUNS = [
    (
        "prefill over buckets below 3 tokens",
        ["capture", *CPU, "--scenario", "prefill", "--buckets", "1,2", "--num-iters", "1", "--num-iters-warmup", "0"],
    ),
    (
        "verify over buckets below 5 tokens",
        ["verify", *CPU, "--buckets", "1,2", "--max-num-seqs", "2", "--steps", "2", "--check-every", "1"],
    ),
    # gmtool's own default prefill mixes held more sequences than --max-num-seqs: every row an error
    (
        "prefill defaults within --max-num-seqs 1",
        [
            "capture",
            *CPU,
            "--scenario",
            "prefill",
            "--max-num-seqs",
            "1",
            "--num-iters",
            "1",
            "--num-iters-warmup",
            "0",
        ],
    ),
    # verify's KV cache held too few blocks for its dynamic-dimension decode pair when a sequence has < 4 blocks
    ("verify --block-size 16 on the CPU", ["verify", *CPU, "--block-size", "16", "--steps", "1", "--check-every", "1"]),
]


@pytest.mark.parametrize("case, args", RUNS, ids=[c[0] for c in RUNS])
def test_small_runs_are_not_tracebacks(tmp_path, case, args):
    code, _, stderr = run_cli(*args, "--out", tmp_path / "o")
    assert code == 0 and "Traceback" not in stderr, stderr


def test_an_option_repeated_with_the_same_value_is_not_refused():
    from gmtool.cli.main import app
    from gmtool.cli.repeats import refuse_repeated

    import typer

    group = typer.main.get_command(app)
    refuse_repeated(group, ["capture", "--buckets", "1,2", "--buckets=1,2", "--fuse", "--fuse"])
    refuse_repeated(group, ["capture", "--model", "--buckets", "--buckets", "2"])  # --model's value, then --buckets
    refuse_repeated(group, ["capture", "--model", "a", "--model"])  # no value: click's to say, not a repeat
    refuse_repeated(group, ["capture", "--", "--buckets", "1", "--buckets", "2"])  # past --, nothing is an option
    refuse_repeated(group, ["capture", "--model", "a", "--out", "--model"])  # --out's value, not a second --model
    with pytest.raises(GmtoolError, match=r"--model given 2 times \('a' then 'b'\)"):
        refuse_repeated(group, ["capture", "-ma", "-mb"])  # short options with their values attached


@pytest.mark.parametrize("value", ["maybe", "disable", "2"])
def test_a_switch_set_to_neither_an_on_nor_an_off_word_is_refused(tmp_path, monkeypatch, value):
    """GMTOOL_COMPILE_AHEAD=disable read as on: the run went on with the pass the user meant to turn off."""
    from tests.test_compare import one_error, run_cli

    monkeypatch.setenv("GMTOOL_COMPILE_AHEAD", value)
    code, _, err = run_cli("capture", "--buckets", "1", "--out", tmp_path / "o")
    assert code == 2 and f"GMTOOL_COMPILE_AHEAD={value!r}: give 0/false/off/no" in one_error(err)
    assert not (tmp_path / "o").exists()
    code, out, _ = run_cli("capture", "--help")  # refused where a run reads it, not on a help page
    assert code == 0 and "Usage" in out
    for fine in ("off", " No ", "1", "yes", ""):
        monkeypatch.setenv("GMTOOL_COMPILE_AHEAD", fine)
        from gmtool.switches import check_switches

        check_switches()


def test_paths_that_look_like_markup_are_printed_as_they_are(tmp_path):
    """The files-written line of a run (and report's) printed its paths as rich markup: '[/b]' in a path was a
    traceback after the results were written, '[red]' vanished."""
    from tests.test_compare import run_cli

    out = tmp_path / "run[/b][red]"
    code, stdout, err = run_cli("capture", *CPU, "--buckets", "1", "--num-iters", "1", "--num-iters-warmup", "0",
                                "--out", out)  # fmt: skip
    assert code == 0, err
    assert "run[/b][red]" in stdout.replace("\n", ""), stdout
    code, stdout, err = run_cli("report", out, "--out", tmp_path / "rep[/b]")
    assert code == 0 and "rep[/b]" in stdout, (stdout, err)
