"""The device audit (issue 21, ADR 0016): the batched target's step run on a fake CUDA device.

`tests/fakedevice.py` gives fake CUDA tensors on this CPU-only build: a host tensor meeting a
device one raises, reading a value back raises, and every copy to the host is recorded. A
random-init model of each architecture the runner serves (Llama with GQA and biases, Qwen3
with q/k norms) is loaded there in bf16, and one batched target step runs a prefill chunk, a
plain row, greedy verify rows, sampled verify rows with and without a q, and their rollback.

The rule checked: the step's only copy to the host is the designated one
(`models/device.to_host`), once per step, and it carries the verdicts (emitted tokens,
accepted counts, p and q of the drafts: at most 2 + 2K numbers per row), not logits. The
audit replaces that copy with one that returns real host numbers of the same shape, so the
host side of the step (verdicts, rollback, bookkeeping) runs for real.
"""

from __future__ import annotations

import pytest
import torch
from fakedevice import fake_cuda
from torch._subclasses.fake_tensor import unset_fake_temporarily
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import specserve.device as device_module
import specserve.models.verifier as verifier_module
import specserve.worker.model_step as model_step_module
from specserve.algorithm.rejection import SparseQ
from specserve.drafters.base import DraftProposal
from specserve.drafters.hf import HFDrafter
from specserve.models.verifier import TargetModel
from specserve.params import SamplingParams
from specserve.step import Kind, Step, StepRow
from specserve.worker.batcher import Work
from specserve.worker.model_step import BatchedDraft, BatchedTarget, Batching

SHAPE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
ARCHITECTURES = {
    "llama-gqa-bias": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=True, tie_word_embeddings=False)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)),
}


K_MAX = 4  # the most drafts of a row in `_jobs`


class DesignatedCopy:
    """Stands in for `to_host`: records what crossed and returns real zeros of its shape
    (a verdict of 0 accepted drafts and token 0, valid for every row). A copy wider than a
    verdict (2 + 2K numbers per row: logits, say) fails at once."""

    def __init__(self, max_width: int = 2 + 2 * K_MAX) -> None:
        self.calls: list[list[tuple[str, tuple[int, ...]]]] = []
        self.max_width = max_width

    def __call__(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls.append([(r.device.type, tuple(r.shape)) for r in rows])
        wide = [tuple(r.shape) for r in rows if r.shape[-1] > self.max_width]
        assert not wide, f"the step copies {wide} to the host (logits?), not its results"
        with unset_fake_temporarily():
            return [torch.zeros(r.shape, dtype=r.dtype) for r in rows]


def _jobs(engine: BatchedTarget, vocab: int) -> list[Work]:
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    coupled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, coupled=True)
    with unset_fake_temporarily():
        q = SparseQ(torch.tensor([[5, 6, 0], [7, 8, 0]]), torch.tensor([[0.6, 0.4, 0.0], [0.9, 0.1, 0.0]]))
    prompt = [(3 * i) % vocab for i in range(1, 21)]
    jobs = {
        "prefill": StepRow.verify(None, prompt, [], None, greedy, 1),  # 20 tokens, chunks of 8: again
        "plain": StepRow.verify(None, [1, 2, 3], [], None, greedy, 2),
        "greedy-k3": StepRow.verify(None, [4, 5, 6, 7], [8, 9, 10], None, greedy, 3),
        "greedy-k1-banned": StepRow.verify(None, [4, 5], [6], None, SamplingParams(banned_token_ids=(0, 7)), 4),
        "sampled-sparse-q": StepRow.verify(None, [9, 8, 7], [5, 7], q, sampled, 5),
        "sampled-one-hot": StepRow.verify(None, [11, 12], [13, 14, 15, 16], None, sampled, 6),
        # a seed the client chose: the coupled verdict, its noise made on the device (ADR 0027)
        "seeded-sparse-q": StepRow.verify(None, [9, 8, 6], [5, 7], q, coupled, 7),
        "seeded-one-hot": StepRow.verify(None, [10, 12], [13, 14, 15], None, coupled, 8),
    }
    out = []
    for name, job in jobs.items():
        job.slot = engine.open(name)
        out.append(Work(name, job, 1))
    return out


@pytest.mark.parametrize("tile", [4, None], ids=["invariant", "fast"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_batched_target_step_on_a_fake_cuda_device_copies_only_its_verdicts_to_the_host(arch, tile, monkeypatch):
    """exact_batching "fast" on CUDA attends the short rows in one padded call (ShortRows)."""
    copy = DesignatedCopy()
    monkeypatch.setattr(verifier_module, "to_host", copy, raising=False)
    monkeypatch.setattr(model_step_module, "to_host", copy)  # where the step copied its logits before
    # the KV budget on CUDA is what the device's memory leaves after the weights: a 1 GiB device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 - 2**20, 2**30))
    monkeypatch.setattr(device_module, "_can_pin", lambda: True)  # to_device's CUDA path: pinned, non-blocking
    with fake_cuda() as (_, host_copies):
        model = ARCHITECTURES[arch]().eval()
        target = TargetModel(model)
        engine = BatchedTarget(target, Batching(kv_budget_mb=1, max_sessions=8, max_len=64, prefill_chunk=8,
                                                device="cuda", dtype="bf16", fuse_upto=0, tile=tile,
                                                cuda_graphs="off"))
        assert engine.runner.short_rows == (tile is None)
        assert engine.runner.w.embed.device.type == "cuda" and engine.runner.kv.keys[0].device.type == "cuda"
        assert engine.runner.w.embed.dtype is torch.bfloat16
        batch = _jobs(engine, SHAPE["vocab_size"])
        for _ in range(2):  # the second step: the prompt's next chunk beside the others' new rows
            copy.calls.clear()
            host_copies.copies.clear()
            host_copies.blocking_in.clear()
            results = engine.step(Step([w.payload for w in batch])).rows
            assert host_copies.copies == [], f"copies to the host outside the designated one: {host_copies.copies}"
            # found on an H100 (torch.cuda.set_sync_debug_mode): each blocking copy in waited for the GPU
            assert host_copies.blocking_in == [], f"blocking copies to the device: {host_copies.blocking_in}"
            assert len(copy.calls) == 1, f"the designated copy ran {len(copy.calls)} times in one step"
            ((device, shape),) = copy.calls[0]
            judged = [w for w, r in zip(batch, results, strict=True) if r.verdict is not None]
            kmax = max(len(w.payload.drafts) for w in judged)
            assert device == "cuda" and shape[0] == len(judged) and shape[1] <= 2 + 2 * kmax, \
                f"the step copied {shape} (logits?), not {len(judged)} verdicts"
            for w, r in zip(batch, results, strict=True):
                if w.session == "prefill":
                    assert r.again
                    continue
                # the zeros that crossed mean "no draft accepted, token 0": the drafts left the KV
                assert r.verdict is not None, (w.session, r)
                assert (r.verdict.num_accepted, r.verdict.tokens) == (0, [0])
                assert r.cached_len == len(w.payload.ids) == engine.runner.length(w.payload.slot)
                w.payload.ids = w.payload.ids + r.verdict.tokens  # committed: the next step's row


INDICES = [1, -1, slice(0, 2), slice(None, None, 2), None, (Ellipsis, 1), (slice(None), None), (0, slice(1, 3)),
           (Ellipsis, None), [0, 2], (slice(None), [1, 3]), ([0, 2], slice(None), [1, 4]), (1, [0, 3]),
           ([0, 1], 2), (1, slice(None), [0, 4]), (Ellipsis, [4, 0])]


@pytest.mark.parametrize("idx", INDICES, ids=[repr(i) for i in INDICES])
def test_the_audits_lowered_indexing_is_pytorchs_own(idx):
    """The harness must not change what a step computes: its lowering of t[idx] and
    t[idx] = v gives PyTorch's own results on real tensors."""
    from fakedevice import getitem, setitem

    x = torch.arange(60.0).view(3, 4, 5)
    ix = tuple(torch.tensor(i) if isinstance(i, list) else i for i in (idx if isinstance(idx, tuple) else (idx,)))
    want = x[ix]
    got = getitem(x, ix)
    assert got.shape == want.shape and torch.equal(got, want)
    a, b = x.clone(), x.clone()
    a[ix] = -1.0
    setitem(b, ix, -1.0)
    assert torch.equal(a, b)


Q_ENTRIES = 16  # the draft's q cap in the audit: sparse on the wire (16 <= 0.25 x 211)


def _draft_jobs(engine: BatchedDraft) -> list[Work]:
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    prompt = [(5 * i) % SHAPE["vocab_size"] for i in range(1, 21)]
    jobs = {
        "prefill": StepRow.draft(None, prompt, 3, greedy, 1),  # 20 tokens, chunks of 8: again
        "greedy-k3": StepRow.draft(None, [1, 2, 3], 3, greedy, 2),
        "greedy-k2-banned": StepRow.draft(None, [4, 5], 2, SamplingParams(banned_token_ids=(0, 7)), 3),
        "sampled-k4": StepRow.draft(None, [9, 8, 7], 4, sampled, 4),
        "sampled-k1": StepRow.draft(None, [6], 1, SamplingParams(temperature=1.0), 5),
        "guess-greedy": StepRow.guess(None, [11, 12], greedy, 6),
        "guess-sampled": StepRow.guess(None, [13, 14, 15], sampled, 7),
    }
    out = []
    for name, job in jobs.items():
        job.slot = engine.open(name)
        out.append(Work(name, job, 1))
    return out


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_batched_draft_step_on_a_fake_cuda_device_copies_only_its_picks_to_the_host(arch, monkeypatch):
    """K forwards, each fed the previous picks from the device; one copy at the end of at
    most 4 + 2E numbers per drafted position (token, runner-up, two confidences, q's E
    entries), not logits."""
    copy = DesignatedCopy(max_width=4 + 2 * Q_ENTRIES)
    monkeypatch.setattr(model_step_module, "to_host", copy)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 - 2**20, 2**30))
    monkeypatch.setattr(device_module, "_can_pin", lambda: True)  # to_device's CUDA path: pinned, non-blocking
    with fake_cuda() as (_, host_copies):
        model = ARCHITECTURES[arch]().eval()
        engine = BatchedDraft(HFDrafter(model, q_max_entries=Q_ENTRIES),
                              Batching(kv_budget_mb=1, max_sessions=8, max_len=64, prefill_chunk=8, device="cuda",
                                       dtype="bf16", fuse_upto=0, cuda_graphs="off"))
        assert engine.runner.w.embed.device.type == "cuda"
        batch = _draft_jobs(engine)
        for _ in range(3):  # the prompt's chunks of 8 (8, 16, its last 5) beside the others' next blocks
            copy.calls.clear()
            host_copies.copies.clear()
            host_copies.blocking_in.clear()
            results = engine.step(Step([w.payload for w in batch])).rows
            assert host_copies.copies == [], f"copies to the host outside the designated one: {host_copies.copies}"
            # found on an H100 (torch.cuda.set_sync_debug_mode): each blocking copy in waited for the GPU
            assert host_copies.blocking_in == [], f"blocking copies to the device: {host_copies.blocking_in}"
            assert len(copy.calls) == 1, f"the designated copy ran {len(copy.calls)} times in one step"
            shapes = copy.calls[0]
            finished = [(w, r) for w, r in zip(batch, results, strict=True) if not r.again]
            # one [k, width] row block per finished job (in the step's own order), on the device
            assert all(d == "cuda" for d, _ in shapes)
            assert sorted(shape[0] for _, shape in shapes) == sorted(w.payload.k for w, _ in finished)
            for w, r in finished:
                job = w.payload
                if job.kind is Kind.GUESS:
                    assert r.guess == 0, (w.session, r)
                    continue
                # the zeros that crossed: token 0 at every position, runner-up 0, an empty q
                p = r.proposal
                assert isinstance(p, DraftProposal), (w.session, r)
                assert p.tokens == [0] * job.k and p.runner_up == [0] * job.k
                assert (p.q is None) == job.sampling.greedy
                # the KV holds the committed tokens and the k - 1 picks fed from the device,
                # named once they crossed
                assert engine.runner.kv.ids[engine.runner.kv.slot(job.slot)] == job.ids + [0] * (job.k - 1)
            for w in batch:
                w.payload.ids = w.payload.ids + [1]  # one more committed token for the next step
        assert not results[0].again  # the prompt's last chunk went in the third step: drafted there
