"""After a rejection, the draft's and the target's caches give the logits a fresh prefill
of the committed prefix gives (up to float32 kernel-shape noise: atol 1e-4 on logits of
magnitude ~10, far below any difference a wrong cache position would make)."""

import torch

from specserve.algorithm.sampling import SamplingParams
from specserve.drafters import HFDrafter
from specserve.models.kvcache import CachedLM

ATOL = 1e-4


def _fresh_logits(model, ids):
    return CachedLM(model).extend(ids)[-1]


def test_target_rollback_matches_fresh_prefill(demo_pair, target_model, eval_prompts):
    ids = demo_pair.tokenizer.encode(eval_prompts[3]["prompt"])
    session = target_model.start()
    greedy = session.verify(ids, []).argmax(-1).tolist()
    # a block whose 2nd draft is wrong: keep [good], reject the rest
    good = greedy[0]
    wrong = (good + 1) % target_model.vocab_size
    logits = session.verify(ids, [good, wrong, wrong, wrong])
    assert logits.shape[0] == 5
    session.rollback(len(ids) + 1)
    assert session.lm.length == len(ids) + 1 and session.dropped_positions == 3
    nxt = int(logits[1].argmax())
    after = session.verify(ids + [good, nxt], [])[-1]
    assert torch.allclose(after, _fresh_logits(demo_pair.target, ids + [good, nxt]), atol=ATOL)


def test_draft_reconcile_after_rejection_matches_fresh_prefill(demo_pair, eval_prompts):
    drafter = HFDrafter(demo_pair.draft)
    session = drafter.start()
    ids = demo_pair.tokenizer.encode(eval_prompts[15]["prompt"])
    sp = SamplingParams()
    first = session.propose(ids, 5, sp, seed=0)
    assert len(first.tokens) == 5 and session.lm.length == len(ids) + 4
    # the target accepted 2 drafts then recovered a different token
    recovered = (first.tokens[2] + 1) % drafter.vocab_size
    committed = ids + first.tokens[:2] + [recovered]
    second = session.propose(committed, 3, sp, seed=0)
    assert second.dropped_on_reconcile == 2  # drafts 3 and 4 were provisional and dropped
    fresh = drafter.start()
    assert fresh.propose(committed, 3, sp, seed=0).tokens == second.tokens
    session.lm.crop(len(committed))
    cached = session.lm.extend([second.tokens[0]])[-1]
    assert torch.allclose(cached, _fresh_logits(demo_pair.draft, committed + [second.tokens[0]]), atol=ATOL)


def test_crop_to_zero_and_regrow(demo_pair):
    lm = CachedLM(demo_pair.target)
    lm.extend([5, 6, 7])
    lm.crop(0)
    assert lm.length == 0
    assert torch.allclose(lm.extend([8, 9])[-1], _fresh_logits(demo_pair.target, [8, 9]), atol=ATOL)
