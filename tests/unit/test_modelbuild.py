import dataclasses
import json
import time

import pytest

from specserve.tooling.modelbuild.build import PRESETS, build_pair, pair_dir, weights_digest
from specserve.tooling.modelbuild.corpus import CLASSES, build_corpus


@pytest.fixture(scope="module")
def micro_pair_dir(tmp_path_factory):
    """The whole recipe on the micro preset (seconds): the only pair the suite trains."""
    return build_pair(PRESETS["micro"], tmp_path_factory.mktemp("models"), log=lambda *_: None)


def test_pair_layout_and_cache_hit(micro_pair_dir):
    meta = json.loads((micro_pair_dir / "build.json").read_text())
    assert meta["digest"] == PRESETS["micro"].digest()
    assert micro_pair_dir == pair_dir(micro_pair_dir.parent, PRESETS["micro"])
    for part in ("target", "draft"):
        assert (micro_pair_dir / part / "config.json").exists()
        assert (micro_pair_dir / part / "tokenizer.json").exists()
    assert meta["target_params"] > 2 * meta["draft_params"]
    t = time.perf_counter()
    again = build_pair(PRESETS["micro"], micro_pair_dir.parent, log=lambda *_: None)
    assert again == micro_pair_dir and time.perf_counter() - t < 5  # cached by config hash


def test_the_committed_demo_pair_is_what_its_card_says(demo_pair_dir):
    """The shipped weights are the ones the model card and build.json name (sha256), stored
    in bf16 and loaded exactly (the fp32 upcast of bf16 is lossless), within 64 MB."""
    meta = json.loads((demo_pair_dir / "build.json").read_text())
    assert meta["weights_sha256"] == weights_digest(demo_pair_dir)
    # the recipe itself (the digest also encodes this CPU's bf16 support, so it is per machine type)
    assert meta["config"] == json.loads(json.dumps(dataclasses.asdict(PRESETS["demo"])))
    assert meta["weights_sha256"] in (demo_pair_dir / "MODEL_CARD.md").read_text()
    size = sum(f.stat().st_size for f in demo_pair_dir.rglob("*") if f.is_file())
    assert size <= 64 * 2**20, f"{size / 2**20:.1f} MB"
    assert json.loads((demo_pair_dir / "target" / "config.json").read_text())["dtype"] == "bfloat16"


def test_corpus_is_deterministic_and_covers_three_classes():
    a = build_corpus(1_500_000, 300_000, 20, seed=3)
    b = build_corpus(1_500_000, 300_000, 20, seed=3)
    assert a.fingerprint() == b.fingerprint()
    for cls in CLASSES:
        assert a.train[cls] and a.heldout[cls]
        assert not set(a.train[cls]) & set(a.heldout[cls])  # held-out really is held out
    assert build_corpus(1_500_000, 300_000, 20, seed=4).fingerprint() != a.fingerprint()


def test_eval_prompts_cover_classes(demo_pair_dir, demo_pair):
    from specserve.tooling.modelbuild.build import load_eval_prompts

    eval_prompts = load_eval_prompts(demo_pair_dir)
    by_class = {c: [p for p in eval_prompts if p["workload_class"] == c] for c in CLASSES}
    assert all(len(v) >= 20 for v in by_class.values())
    assert all(demo_pair.tokenizer.encode(p["prompt"]) for p in eval_prompts)


def test_digest_changes_with_config():
    from dataclasses import replace

    assert replace(PRESETS["micro"], seed=1).digest() != PRESETS["micro"].digest()


def test_two_builds_of_one_config_have_the_same_weights(micro_pair_dir, tmp_path):
    """The cached micro pair is one build, a forced rebuild here the other: same config, same
    sha256 over weights and tokenizer (bf16 autocast included, where the CPU has it)."""
    meta = json.loads((micro_pair_dir / "build.json").read_text())
    assert meta["weights_sha256"] == weights_digest(micro_pair_dir)  # the record matches the files
    again = build_pair(PRESETS["micro"], tmp_path, force=True, log=lambda *_: None)
    assert json.loads((again / "build.json").read_text())["weights_sha256"] == meta["weights_sha256"]
    assert (again / "eval_prompts.json").read_text() == (micro_pair_dir / "eval_prompts.json").read_text()


def test_find_pair_takes_the_pair_or_the_models_dir(tmp_path):
    import pytest

    from specserve.tooling.modelbuild.build import find_pair

    pair = tmp_path / "default-abc"
    (pair / "target").mkdir(parents=True)
    (tmp_path / "default").symlink_to(pair.name)
    assert find_pair(tmp_path) == pair.resolve()  # `make bench` passes the models dir
    assert find_pair(pair) == pair.resolve()
    with pytest.raises(SystemExit, match="specserve-demo-v1"):
        find_pair(tmp_path / "nothing")
