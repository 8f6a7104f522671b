"""Constraints compiled with xgrammar against the pair's tokenizer, and each session's matcher
(ADR 0017).

- `GrammarCache` compiles a `Constraint` once per (constraint, tokenizer) and refuses one that
  does not compile, or that no token of the vocabulary can start, with the compiler's message.
- `ConstrainedRow` is one session's matcher. Each round it gives the target the legal tokens
  at every position it verifies (the matcher advanced over the drafted prefix, then rolled
  back), drafts the tokens the grammar forces (q one-hot: no draft model spends a forward on
  them), and advances over what the round committed.

Masks are boolean [positions, V] tensors: the verifier applies them to the logits before the
one sampling transform, so greedy picks the legal argmax and T > 0 samples the target's
distribution renormalised over the legal tokens (DESIGN §3, invariant 4).

Example:
    cache = GrammarCache(tokenizer_info_from_file("models/x/target/tokenizer.json", 4096, [0]))
    row = ConstrainedRow(cache.compile(Constraint.json_object()), 4096)
    drafts, q, allowed = row.constrain(drafts=[], q=None, greedy=True, k_max=8)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from specserve.algorithm.rejection import DenseQ, QProbs, SparseQ
from specserve.device import to_device
from specserve.drafters.base import DraftProposal
from specserve.errors import InvalidRequest
from specserve.structured.constraint import Constraint

ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
LEADING_SPACE = 'root ::= " " | ""'
MAX_FORCED = 16  # forced tokens drafted past a round's K (a JSON key, a closing brace run)
_BITS = torch.arange(32, dtype=torch.int32)


def tokenizer_info(tokenizer_json: str, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of a `tokenizers` tokenizer (the router has no transformers tokenizer):
    the vocabulary by id, padded to the model's logits width, and the decoding metadata."""
    import xgrammar as xgr
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    vocab = tok.get_vocab(with_added_tokens=True)
    width = max(vocab_size, max(vocab.values()) + 1)
    encoded = [""] * width
    for token, idx in vocab.items():
        encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=width, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=meta["add_prefix_space"])


def _choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are EBNF's)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCache:
    """Compilations by constraint (one tokenizer per cache), least recently used dropped."""

    def __init__(self, info: Any, capacity: int = 256) -> None:
        import xgrammar as xgr

        self.info = info
        self.vocab_size = int(info.vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.capacity = capacity
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, c: Constraint) -> Any:
        with self._lock:
            got = self._compiled.get(c.key)
            if got is not None:
                self._compiled.move_to_end(c.key)
                self.hits += 1
                return got
        compiled = self._compile(c)
        with self._lock:
            self.misses += 1
            self._compiled[c.key] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, c: Constraint) -> Any:
        import xgrammar as xgr

        try:
            if c.kind in ("json_object", "json_schema"):
                # json_object: an object (xgrammar's builtin JSON also allows an array).
                # Fixed whitespace, json.dumps' separators (what models see most): every
                # separator is forced, and a small model cannot loop on blanks; one optional
                # leading space, as text after a prompt usually starts (" {"), which JSON
                # parsers accept (ADR 0017)
                body = xgr.Grammar.from_json_schema(ANY_OBJECT if c.kind == "json_object" else c.value,
                                                    any_whitespace=False, separators=(", ", ": "),
                                                    strict_mode=c.kind == "json_schema")
                compiled = self.compiler.compile_grammar(xgr.Grammar.concat(xgr.Grammar.from_ebnf(LEADING_SPACE), body))
            elif c.kind == "regex":
                compiled = self.compiler.compile_regex(c.value)
            elif c.kind == "grammar":
                compiled = self.compiler.compile_grammar(c.value)
            else:
                compiled = self.compiler.compile_grammar(_choice_grammar(c.choices()))
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequest(f"the {c.kind} constraint does not compile: {_first_line(exc)}") from None
        probe = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        probe.fill_next_token_bitmask(mask)
        if not bool(unpack(mask, self.vocab_size).any()):
            raise InvalidRequest(f"the {c.kind} constraint cannot be satisfied: no token of the model's "
                                 "vocabulary can start it")
        return compiled


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    # xgrammar prefixes its messages with "[time] file:line: Check failed: ..."; keep the reason
    for marker in ("Check failed: (error.empty()) is false: ", "Check failed: "):
        if marker in text:
            text = text.split(marker, 1)[1]
            break
    return text.splitlines()[0][:500] if text else type(exc).__name__


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [n, ceil(V/32)] -> bool [n, V] (bit j of word w: token 32w+j)."""
    n = bitmask.shape[0]
    return ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().reshape(n, -1)[:, :vocab_size]


def _one_hot_q(q: QProbs, start: int, tokens: Sequence[int], vocab: int) -> QProbs:
    """q for drafts `start..` replaced by forced tokens (one-hot rows); None stays None
    (one-hot at the drafts already)."""
    if q is None or not tokens:
        return q
    if isinstance(q, DenseQ):
        rows = torch.nn.functional.one_hot(torch.tensor(list(tokens)), vocab).float()
        return DenseQ(torch.cat([q.probs[:start], rows], dim=0))
    assert isinstance(q, SparseQ)
    width = q.ids.shape[1]
    ids = torch.zeros(len(tokens), width, dtype=q.ids.dtype)
    probs = torch.zeros(len(tokens), width, dtype=q.probs.dtype)
    ids[:, 0] = torch.tensor(list(tokens), dtype=q.ids.dtype)
    probs[:, 0] = 1.0
    return SparseQ(torch.cat([q.ids[:start], ids]), torch.cat([q.probs[:start], probs]))


class ConstrainedRow:
    """One session's matcher: masks for a round, forced drafts, and the committed tokens."""

    def __init__(self, compiled: Any, vocab_size: int, logits_width: int | None = None,
                 forced_drafts: bool = True, encode: Callable[[str], list[int]] | None = None) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)  # (its rollback is unlimited)
        self.vocab_size = vocab_size
        self.width = logits_width or vocab_size
        self.forced_drafts = forced_drafts
        self.encode = encode  # text -> ids: drafts the grammar's forced string (jump-forward)
        self._buf: torch.Tensor | None = None  # a round's masks, one row per position (grown as needed)
        self.forced_total = 0  # drafts the grammar supplied (no draft forward spent on them)

    def _forced_string(self) -> list[int]:
        """The tokens of the text the grammar forces next ('{"name":"' for a schema whose
        first key is `name`), as the tokenizer splits it; a split the model would not make is
        just a rejected draft (q one-hot: lossless at any temperature)."""
        text = self.matcher.find_jump_forward_string()
        return list(self.encode(text)) if text and self.encode is not None else []

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_terminated())

    def advance(self, tokens: Sequence[int]) -> None:
        """The round's committed tokens (each legal: the target sampled them under the mask)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(t)):
                raise RuntimeError(f"token {t} broke the constraint it was sampled under")

    def constrain(self, drafts: Sequence[int], q: QProbs, greedy: bool, k_max: int,
                  room: int | None = None) -> tuple[list[int], QProbs, torch.Tensor]:
        """This round's drafts, their q and the legal tokens at each of the len(drafts) + 1
        positions the target verifies.

        - A model draft the grammar forbids is rejected by the target's mask anyway: at greedy
          the drafts stop before it (nothing after it can be accepted); at T > 0 it stays (the
          draft sampled it, and rejection sampling must see what it sampled), and the positions
          past it copy its mask (never used: the round rejects at or before it).
        - Where the grammar allows exactly one token, that token is the draft (q one-hot; the
          target's masked p is one-hot too, so it is always accepted): in place of a model
          draft that differs from it (the model's later drafts assumed its own token and are
          dropped), and after the model's drafts, up to k_max + MAX_FORCED in all, and never
          more than `room` (the tokens the budget has left after this round's own).
        """
        drafts = list(drafts)
        out: list[int] = []
        forced_from: int | None = None  # the first position whose draft the grammar supplied
        advanced = 0
        illegal = False
        pending: list[int] = []  # the forced string's tokens, still to draft
        limit = max(k_max, len(drafts)) + (MAX_FORCED if self.forced_drafts else 0)
        if room is not None:
            limit = min(limit, max(room, 0))
        buf = self._buffer(limit + 1)
        words = buf.numpy()
        filled = 0  # rows of `buf` filled: the masks at positions 0..filled-1
        try:
            while not self.matcher.is_terminated():  # (after a stop token: the round ends there)
                i = len(out)
                self.matcher.fill_next_token_bitmask(buf, i)
                filled = i + 1
                if illegal or i >= limit:
                    break
                tok, model, pending = self._pick(words[i], drafts if forced_from is None else [], i, pending)
                if tok is None:
                    break
                if forced_from is None and (model is None or tok != model):
                    forced_from = i
                if not _has(words[i], tok):  # an illegal draft
                    if greedy or model is None or tok != model:
                        break  # (a forced-string token the tokenizer split otherwise: stop there)
                    illegal = True
                    out.append(tok)
                    continue
                out.append(tok)
                if not self.matcher.accept_token(tok):
                    raise RuntimeError(f"the matcher refused token {tok} its own mask allowed")
                advanced += 1
        finally:
            if advanced:
                self.matcher.rollback(advanced)
        if forced_from is not None:
            self.forced_total += len(out) - forced_from
            q = _one_hot_q(q, forced_from, out[forced_from:], self.width) if q is not None else None
        elif q is not None and len(out) < len(drafts):
            q = trim_q(q, len(out))
        return out, q, self._masks(buf, filled, len(out) + 1)

    def constrain_tree(self, tokens: Sequence[int], parents: Sequence[int]
                       ) -> tuple[list[int], list[int], torch.Tensor] | None:
        """A token tree's nodes the grammar allows and the legal tokens at each of its nodes
        (ADR 0020): [m + 1, width] bool, the root's row first (the position after the committed
        prefix), then each kept node's (the position after its path). A node the grammar
        forbids at its parent is dropped with its subtree (the target could never accept it;
        at T > 0 too, since a tree's candidates were chosen without draws), as are the
        children of a node that ends the output. The kept nodes stay depth-first, siblings in
        their order. None where the grammar forces the root's token: the chain path drafts
        what it forces (jump-forward), which a tree would give up."""
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        for i, p in enumerate(parents):
            children[p + 1].append(i + 1)
        buf = self._buffer(len(tokens) + 1)
        words = buf.numpy()
        self.matcher.fill_next_token_bitmask(buf, 0)
        if self.forced_drafts and _only_token(words[0]) is not None:
            return None
        out: list[int] = []
        out_parents: list[int] = []
        rows = [0]  # per kept node (the root first): its row in `buf`

        def visit(node: int, row: int, new_index: int) -> None:
            if self.matcher.is_terminated():
                return
            for c in children[node]:
                tok = int(tokens[c - 1])
                if not _has(words[row], tok) or not self.matcher.accept_token(tok):
                    continue
                out.append(tok)
                out_parents.append(new_index)
                mine = len(rows)
                rows.append(mine)
                if self.matcher.is_terminated():
                    buf[mine] = buf[row]  # (never used: the output ends at this node)
                else:
                    self.matcher.fill_next_token_bitmask(buf, mine)
                visit(c, mine, len(out) - 1)
                self.matcher.rollback(1)

        visit(0, 0, -1)
        return out, out_parents, self._masks(buf, len(rows), len(rows))

    def _pick(self, row: np.ndarray, drafts: list[int], i: int,
              pending: list[int]) -> tuple[int | None, int | None, list[int]]:
        """Position i's draft (None: the drafts end here), the model's draft there (None past
        them) and the forced string's tokens still to draft. The grammar's only legal token
        wins over a model draft that differs; past the model's drafts, the forced string."""
        forced = _only_token(row) if self.forced_drafts else None
        model = drafts[i] if i < len(drafts) else None
        if forced is not None and model != forced:
            return forced, model, (pending[1:] if pending and pending[0] == forced else [])
        if model is not None:
            return model, model, pending
        if not pending and self.forced_drafts and self.encode is not None:
            pending = self._forced_string()
        return (pending[0], None, pending[1:]) if pending else (None, None, pending)

    def _buffer(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._buf is None or self._buf.shape[0] < rows:
            self._buf = xgr.allocate_token_bitmask(max(rows, 8), self.vocab_size)
        return self._buf

    def _masks(self, buf: torch.Tensor, filled: int, rows: int) -> torch.Tensor:
        """[rows, width] bool from the first `filled` rows of the bitmask, in one unpack; rows
        past them (after an illegal draft or a stop token, never used) repeat the last."""
        if filled == 0:
            return torch.ones(rows, self.width, dtype=torch.bool)
        masks = unpack(buf[:filled], self.vocab_size)
        if filled < rows:
            masks = torch.cat([masks, masks[-1:].expand(rows - filled, -1)])
        elif filled > rows:
            masks = masks[:rows]
        if self.width > self.vocab_size:
            masks = torch.cat([masks, torch.zeros(rows, self.width - self.vocab_size, dtype=torch.bool)], dim=1)
        return masks


def _has(words: np.ndarray, token: int) -> bool:
    """Bit `token` of one bitmask row (int32 words)."""
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _only_token(words: np.ndarray) -> int | None:
    """The one token a bitmask row allows, or None when it allows none or several."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):  # more than one bit
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


def trim_q(q: QProbs, n: int) -> QProbs:
    if isinstance(q, DenseQ):
        return DenseQ(q.probs[:n])
    if isinstance(q, SparseQ):
        return SparseQ(q.ids[:n], q.probs[:n])
    return q


class DraftGrammar:
    """The draft side of a constraint (ADR 0017): the draft proposes from its own masked q.
    Each block gets a fresh matcher replayed over the session's generated tokens (cheap: about
    2 µs a token), so blocks drafted ahead or on another thread share no state, and the masks
    are the same on every run (a seeded request's drafts must be)."""

    def __init__(self, compiled: Any, prompt_len: int, vocab_size: int, logits_width: int | None = None) -> None:
        self.compiled = compiled
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size
        self.width = logits_width or vocab_size

    def start(self, ids: Sequence[int]) -> DraftMasks | None:
        """Masks for a block drafted after `ids` (prompt + generated); None where `ids` break
        the constraint (a branch drafted ahead on a guessed token): that block drafts free."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compiled)
        for t in ids[self.prompt_len:]:
            if matcher.is_terminated() or not matcher.accept_token(int(t)):
                return None
        return DraftMasks(matcher, self.vocab_size, self.width)

    def legal_prefix(self, ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """A model-free drafter's drafts up to the first the constraint forbids (the target
        would reject it, and nothing after it can be accepted)."""
        masks = self.start(ids)
        if masks is None:
            return list(drafts)
        out = []
        for t in drafts:
            if not masks.push(t):
                break
            out.append(t)
        return out


class DraftMasks:
    """One block's matcher: the mask at the next drafted position, and each drafted token."""

    def __init__(self, matcher: Any, vocab_size: int, width: int) -> None:
        import xgrammar as xgr

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.width = width
        self.off = False  # a drafted token the grammar refused: the rest of the block drafts free
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [V] with the illegal tokens at -inf (unchanged once the grammar
        has ended: the block's later positions are never verified)."""
        if self.off or self.matcher.is_terminated():
            return logits
        self.matcher.fill_next_token_bitmask(self._mask)
        allowed = unpack(self._mask, self.vocab_size)[0]
        if not bool(allowed.any()):
            return logits
        if self.width > self.vocab_size:
            allowed = torch.cat([allowed, torch.zeros(self.width - self.vocab_size, dtype=torch.bool)])
        return logits.masked_fill(~to_device(allowed, logits.device), float("-inf"))

    def push(self, token: int) -> bool:
        """The drafted token; False when the grammar forbids it (or has ended), and masking
        stops there: the target rejects at or before that position, so what follows in the
        block is never accepted."""
        if not self.off and not self.matcher.is_terminated() and self.matcher.accept_token(int(token)):
            return True
        self.off = True
        return False


def propose_constrained(session: Any, ids: list[int], k: int, sampling: Any, seed: int,
                        grammar: Any) -> DraftProposal:
    """A draft session's block under a constraint (ADR 0017): a model drafter samples from its
    masked q; a model-free one's drafts stop before the first the constraint forbids."""
    if grammar is None:
        return session.propose(ids, k, sampling, seed)
    from specserve.drafters.hf import HFDraftSession

    if isinstance(session, HFDraftSession):
        return session.propose(ids, k, sampling, seed, grammar=grammar)
    proposal = session.propose(ids, k, sampling, seed)
    legal = grammar.legal_prefix(ids, proposal.tokens)
    if len(legal) == len(proposal.tokens):
        return proposal
    return DraftProposal(legal, trim_q(proposal.q, len(legal)), dropped_on_reconcile=proposal.dropped_on_reconcile,
                         runner_up=proposal.runner_up[:len(legal)] if proposal.runner_up else proposal.runner_up,
                         confidence=proposal.confidence[:len(legal)] if proposal.confidence else proposal.confidence)
