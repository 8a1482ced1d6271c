import dataclasses

import pytest

from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS, BucketKey, BucketPolicy, parse_buckets
from gmtool.core.compositions import assign_buckets, default_compositions, parse_composition, parse_compositions
from gmtool.errors import GmtoolError


def test_parse_buckets_lists_and_ranges():
    assert parse_buckets("1,2,4,8") == [1, 2, 4, 8]
    assert parse_buckets("8:32:8") == [8, 16, 24, 32]
    assert parse_buckets("1, 2,4,8:24:8") == [1, 2, 4, 8, 16, 24]
    assert parse_buckets("1:8,4:16:4,8") == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]  # ranges and a size in one: a union
    assert DEFAULT_DECODE_BUCKETS[:5] == [1, 2, 4, 8, 16] and DEFAULT_DECODE_BUCKETS[-1] == 256


@pytest.mark.parametrize(
    "text", ["", "  ", "1,,2", "a", "1:", "8:4", "8:16:0", "0,1", "-4", "1:2:3:4", "2,2", "1,4,2,4"]
)
def test_parse_buckets_rejects_malformed(text):
    with pytest.raises(GmtoolError):
        parse_buckets(text)


def test_policy_picks_smallest_fitting_bucket():
    p = BucketPolicy([1, 2, 4, 8])
    assert [p.bucket_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(GmtoolError, match="fits no bucket"):
        p.bucket_for(9)
    with pytest.raises(GmtoolError):
        p.bucket_for(0)


def test_policy_rejects_bucket_above_configured_max():
    with pytest.raises(GmtoolError, match="above the configured maximum"):
        BucketPolicy([8, 16, 512], max_tokens=256)


def test_wide_key_only_for_non_decode_batches():
    p = BucketPolicy([16, 32], wide_key=True)
    assert p.key_for(20, 4, decode=False) == BucketKey(32, 4, False)
    assert p.key_for(12, 12, decode=True) == BucketKey(16, None, True)
    assert BucketPolicy([16, 32]).key_for(20, 4, decode=False) == BucketKey(32, None, False)
    assert p.key_for(3, 3, decode=True, pinned=32).num_tokens == 32
    with pytest.raises(GmtoolError):
        p.key_for(20, 1, decode=False, pinned=16)


def test_composition_grammar():
    c = parse_composition("128=100+28@512")
    assert c.bucket == 128 and c.num_tokens == 128 and c.num_seqs == 2 and c.parts[1].prefix == 512
    c = parse_composition("1*13")
    assert c.num_tokens == 13 and c.num_seqs == 13 and c.is_decode and c.bucket is None
    assert parse_composition("32*4").num_seqs == 4
    assert [x.label for x in parse_compositions("64+64, 16*8")] == ["64+64", "16*8"]


@pytest.mark.parametrize(
    "text,msg",
    [
        ("128=100+100", "more than its bucket"),
        ("0*4", "> 0"),
        ("4*0", "> 0"),
        ("-4", "not N"),
        ("x=4", "bucket size"),
        ("4@", "not N"),
        ("4**2", "not N"),
        ("", "empty"),
    ],
)
def test_bad_compositions(text, msg):
    with pytest.raises(GmtoolError, match=msg):
        parse_compositions(text)


def test_default_compositions_land_in_their_bucket():
    policy = BucketPolicy(DEFAULT_DECODE_BUCKETS)
    below = 0
    for b in policy.sizes:
        comps = default_compositions(b, "decode", below)
        assert len(comps) >= 3
        assert all(policy.bucket_for(c.num_tokens) == b for c in comps)
        assert len({c.seed for c in comps}) == len(comps)
        below = b
    for b in (128, 512, 2048):
        comps = default_compositions(b, "prefill", b // 4)
        assert len(comps) >= 3 and all(c.num_tokens <= b for c in comps)


def test_assign_buckets_pins_and_rejects_unknown_bucket():
    policy = BucketPolicy([16, 32])
    groups = assign_buckets(parse_compositions("8+8,32=4*2,20"), policy)
    assert [c.label for c in groups[16]] == ["8+8"]
    assert [c.label for c in groups[32]] == ["4*2", "20"]
    with pytest.raises(GmtoolError, match="not captured"):
        assign_buckets(parse_compositions("64=8"), policy)
    with pytest.raises(GmtoolError, match="fits no bucket"):
        assign_buckets(parse_compositions("40"), policy)


@pytest.mark.parametrize("scenario", ["prefill", "mixed"])
def test_default_mixes_of_every_small_bucket_parse_and_belong_to_it(scenario):
    """Small buckets once made negative prefill chunks ('-3+0@512+1*4') and a prefill bucket 1 got no mix."""
    below = 0
    for bucket in range(1, 70):
        comps = default_compositions(bucket, scenario, below)
        assert comps, bucket
        assert all(below < c.num_tokens <= bucket for c in comps), (bucket, [c.label for c in comps])
        below = bucket


@pytest.mark.parametrize("scenario", ["prefill", "mixed"])
@pytest.mark.parametrize("max_seqs", [1, 2, 3])
def test_default_mixes_stay_within_max_num_seqs(scenario, max_seqs):
    """gmtool's own mixes once had more sequences than --max-num-seqs allows (`capture --scenario prefill
    --max-num-seqs 1` ended in 10 errors): those give way to one-sequence prefills, three or more mixes a bucket,
    each a prefill the bucket serves."""
    below = 0
    for bucket in (16, 32, 64, 128, 512):
        comps = default_compositions(bucket, scenario, below, max_seqs)
        labels = [c.label for c in comps]
        assert all(c.num_seqs <= max_seqs for c in comps), (bucket, labels)
        assert all(below < c.num_tokens <= bucket for c in comps), (bucket, labels)
        assert len(comps) >= 3 and not any(c.is_decode for c in comps), (bucket, labels)
        below = bucket


def test_a_bucket_no_given_composition_reaches_says_it_ran_the_defaults():
    """--compositions that all land on bucket 128 leave bucket 64 to its default mixes: the run says so, rather
    than report mixes nobody asked for without a word."""
    from gmtool.config import SweepConfig

    cfg = SweepConfig(
        device="cpu", scenario="prefill", buckets="64,128", compositions="128=64+64,32*4,100+28@512", max_kv_len=640
    )
    assert [c.label for c in cfg.compositions_by_bucket[128]] == ["64+64", "32*4", "100+28@512"]
    assert cfg.compositions_by_bucket[64]  # the defaults
    said = [n for n in cfg.notes if "--compositions" in n]
    assert len(said) == 1 and "bucket 64 " in said[0] and "default mixes" in said[0]
    again = dataclasses.replace(cfg, seed=1)  # memreport --sample copies the config: the note is not doubled
    assert [n for n in again.notes if "--compositions" in n] == said
    plain = SweepConfig(device="cpu", scenario="prefill", buckets="64,128")  # nothing given: nothing to explain
    assert not [n for n in plain.notes if "--compositions" in n]


def test_a_run_of_given_mixes_only_records_the_scenario_they_make():
    """--scenario chooses default buckets and mixes; where every bucket ran given mixes, the recorded scenario
    (which a report's baseline and plan read) is what ran, and a note says why it differs from --scenario."""
    from gmtool.config import SweepConfig

    cfg = SweepConfig(device="cpu", scenario="prefill", buckets="4", compositions="1*4")
    assert cfg.scenario == "decode" and any(n.startswith("scenario decode, as the --compositions") for n in cfg.notes)
    assert SweepConfig(device="cpu", buckets="8", compositions="5*1").scenario == "prefill"
    assert SweepConfig(device="cpu", buckets="8", compositions="3+1*2").scenario == "mixed"
    kept = SweepConfig(device="cpu", scenario="prefill", buckets="8", compositions="4*2")
    assert kept.scenario == "prefill" and not any(n.startswith("scenario ") for n in kept.notes)
    # a bucket that ran defaults was shaped by --scenario: it stays
    assert SweepConfig(device="cpu", buckets="1,2,8", compositions="5*1").scenario == "decode"
    assert SweepConfig(device="cpu", scenario="prefill", compositions="1*4").scenario == "prefill"  # its buckets
    assert dataclasses.replace(cfg, seed=1).scenario == "decode"


def test_default_mixes_fit_a_given_max_kv_len():
    """The chunk-after-prefix mix's 512-token prefix once refused `--scenario prefill --buckets 8,16,32
    --max-kv-len 128`, a mix the user never asked for: the prefix is what --max-kv-len leaves, or the mix goes."""
    for bucket in (16, 32, 64, 128):
        for most in (4, 40, 128, 4096):
            comps = default_compositions(bucket, "prefill", bucket // 2, None, most)
            chunks = [p.prefix + p.new_tokens for c in comps for p in c.parts if p.prefix]
            assert all(n <= most for n in chunks), (bucket, most, [c.label for c in comps])
    assert [c.label for c in default_compositions(32, "prefill", 16, None, 128)][-1] == "19+8@120+1*4"
    assert [c.label for c in default_compositions(32, "prefill", 16)][-1] == "19+8@512+1*4"
    assert not any("@" in c.label for c in default_compositions(16, "prefill", 8, None, 4))


def test_batches_of_one_bucket_get_its_one_key_object():
    """Copy-in trusts its last write to a key by identity: a key object per batch size made every load after a
    change of size pad in full, so the in-place padding of a shrinking batch never ran in a real run."""
    p = BucketPolicy([8, 16])
    assert p.key_for(7, 7, True) is p.key_for(5, 5, True) is p.key_for(8, 8, True, pinned=8)
    assert p.key_for(7, 2, False) is p.key_for(3, 1, False) and p.key_for(7, 2, False) != p.key_for(7, 7, True)
    wide = BucketPolicy([8, 16], wide_key=True)
    assert wide.key_for(7, 2, False) is wide.key_for(5, 2, False) and wide.key_for(7, 2, False) != wide.key_for(
        7, 3, False
    )
