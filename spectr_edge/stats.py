"""What one generation did and where its time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0           # prompt tokens whose cache was reused from an earlier generation
    new_tokens: int = 0
    num_candidates: int = 0          # k actually used (0 = target only)
    draft_len: int = 0               # L actually used
    target_calls: int = 0            # prefill included
    draft_calls: int = 0
    steps: int = 0                   # speculative steps (one target call each)
    drafted: int = 0                 # draft positions offered for verification (L per step)
    accepted: int = 0                # draft tokens accepted
    undrafted: int = 0               # steps the adaptive length rule decoded plainly (drafting would not pay)
    lookup_steps: int = 0            # steps that verified a prompt-lookup draft (counted in steps too)
    lookup_tries: int = 0            # of those, steps whose copied candidates formed a trie of several branches
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    guess_steps: int = 0             # lookup steps whose draft was the target's guess head's (its first guess,
                                     # and with a chain graph its further guesses)
    guess_drafted: int = 0
    guess_accepted: int = 0
    scored: int = 0                  # tokens the target scored in speculative steps (rows x (L+1), or trie nodes)
    cost_units: float = 0.0          # predicted decode-phase cost, in target decode steps: the cost curve for
                                     # every target call after the prefill, the draft cost for every draft call
    reached: list[int] = field(default_factory=list)       # steps that verified draft position j
    accepted_at: list[int] = field(default_factory=list)   # steps that accepted draft position j
    stop_reason: str = ""            # max_new_tokens | eos | stop | context
    seconds_total: float = 0.0
    seconds_first_token: float = 0.0
    seconds_target: float = 0.0      # inside the target's session.run
    seconds_draft: float = 0.0       # inside the draft's session.run
    seconds_select: float = 0.0      # the selection rules (and the prefill's first token)
    seconds_propose: float = 0.0     # drafting, the draft model's calls included
    seconds_score: float = 0.0       # the target's verification calls, host work around them included
    seconds_commit: float = 0.0      # cache commits and the drafters' updates

    def record_step(self, rows: list, kind: str, scored: int, nodes: int, accepted: int) -> None:
        """Count one verified step: its proposal's rows (none: a plain step, counted as a target call
        only), who drafted them ("model", "lookup", "guess"), the tokens the target scored, the
        proposal's trie nodes (root excluded) and how many drafted tokens were accepted."""
        if not rows:
            return
        depth = max(len(r) for r in rows)
        self.steps += 1
        self.scored += scored
        if len(self.reached) < depth:            # a prompt-lookup step may be longer than the model's L
            self.reached += [0] * (depth - len(self.reached))
            self.accepted_at += [0] * (depth - len(self.accepted_at))
        self.drafted += depth
        self.accepted += accepted
        for j in range(min(accepted + 1, depth)):
            self.reached[j] += 1
        for j in range(accepted):
            self.accepted_at[j] += 1
        if kind in ("lookup", "guess"):
            self.lookup_steps += 1
            self.lookup_drafted += nodes
            self.lookup_accepted += accepted
            self.lookup_tries += len(rows) > 1
        if kind == "guess":
            self.guess_steps += 1
            self.guess_drafted += depth
            self.guess_accepted += accepted

    def add_times(self, propose: float = 0.0, score: float = 0.0, select: float = 0.0, commit: float = 0.0) -> None:
        """Wall time of one step's phases (the decoding loop times them, nothing else does)."""
        self.seconds_propose += propose
        self.seconds_score += score
        self.seconds_select += select
        self.seconds_commit += commit

    @property
    def seconds_other(self) -> float:
        return max(0.0, self.seconds_total - self.seconds_target - self.seconds_draft - self.seconds_select)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def tokens_per_target_call(self) -> float:
        """Tokens emitted per decode-phase target call (the prefill call and its token excluded)."""
        calls = self.target_calls - 1
        return (self.new_tokens - 1) / calls if calls > 0 else float(self.new_tokens > 0)

    @property
    def predicted_speedup(self) -> float:
        """Tokens per predicted unit of time over target-only decoding (1 token per decode step):
        what `spectr-edge tune` compares; from counts and the cost model only, so it is repeatable."""
        return (self.new_tokens - 1) / self.cost_units if self.cost_units > 0 else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds_total if self.seconds_total > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        """Inter-token latency: decode time after the first token, per following token."""
        if self.new_tokens < 2:
            return 0.0
        return 1000 * (self.seconds_total - self.seconds_first_token) / (self.new_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("seconds_other", "acceptance_rate", "acceptance_per_position",
                     "tokens_per_target_call", "predicted_speedup", "tokens_per_second", "ms_per_token"):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        """A few human lines for --stats."""
        lines = [f"prompt {self.prompt_tokens} tokens, generated {self.new_tokens} tokens ({self.stop_reason})",
                 f"time to first token {1000 * self.seconds_first_token:.1f} ms, "
                 f"{self.ms_per_token:.1f} ms/token after it, {self.tokens_per_second:.2f} tokens/s overall"]
        if self.num_candidates:
            per_pos = " ".join(f"{r:.2f}" for r in self.acceptance_per_position)
            lines.append(f"speculative: k={self.num_candidates} L={self.draft_len}, {self.steps} steps, "
                         f"{self.tokens_per_target_call:.2f} tokens per target call, accepted "
                         f"{self.accepted}/{self.drafted} drafted ({100 * self.acceptance_rate:.0f}%), "
                         f"acceptance by position [{per_pos}]")
            if self.undrafted:
                lines.append(f"adaptive length: {self.undrafted} plain steps where drafting would not pay")
            if self.lookup_steps:
                lines.append(f"prompt lookup: {self.lookup_steps} of the steps, accepted {self.lookup_accepted}/"
                             f"{self.lookup_drafted} copied tokens"
                             + (f", {self.lookup_tries} steps verified several candidates as one trie"
                                if self.lookup_tries else "")
                             + (f"; the target's guess head drafted {self.guess_steps} of them, accepted "
                                f"{self.guess_accepted}/{self.guess_drafted} guesses" if self.guess_steps else ""))
        else:
            lines.append("target only (no draft)")
        lines.append(f"calls: target {self.target_calls}, draft {self.draft_calls}; time: target "
                     f"{self.seconds_target:.2f} s, draft {self.seconds_draft:.2f} s, selection "
                     f"{self.seconds_select:.2f} s, other {self.seconds_other:.2f} s")
        return "\n".join(lines)
