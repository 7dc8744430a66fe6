"""Design a boundary function for a hard-constrained PINN, scored by the spectrum of its neural
tangent kernel.

Each seed draws a PDE problem (:mod:`tasks.hc_pinn.problems`) and the network's initialisation.
The agent proposes a boundary function ``B`` for the trial function ``u~ = A + B N`` in the
grammar of :mod:`tasks.hc_pinn.grammar` (``sine 2``, ``exp 8``; a family alone means parameter
1). The environment computes the residual kernel of that HC-PINN at the collocation points and
its eigenspectrum (:mod:`tasks.hc_pinn.ntk`): this is the environment's CPU work, tens of
milliseconds per proposal, and shows in ``env/<name>/env_step_s``. It answers with the effective
rank, the condition number, the top eigenvalue's share and the modes holding 90 % of the trace,
and how the effective rank compares with the best of the commonly used boundary functions
(:data:`tasks.hc_pinn.grammar.COMMON`) on the same problem and network.

A proposal whose effective rank is within ``tolerance`` of that reference succeeds (reward 1,
episode over); otherwise the agent may revise until ``max_turns``. A reply that names no
boundary function is a format error (``-format_penalty``, turn spent). ``info`` carries the
problem, the initialisation seed and every proposal with its spectrum, so a verifier can train
the proposed HC-PINN (:func:`tasks.hc_pinn.verify.hc_pinn_convergence`) or read the spectral
score (:func:`tasks.rewards.hc_pinn_spectral`).
"""

from __future__ import annotations

import functools
import random
from typing import Any

from tasks.hc_pinn.grammar import COMMON, FAMILIES, BoundarySpec, parse_spec
from tasks.hc_pinn.ntk import Spectrum, analyse
from tasks.hc_pinn.problems import PROBLEMS, get_problem

INTRO = "hc pinn : problem {problem} . propose a boundary function as family and power"
HINT = "families " + " ".join(FAMILIES)

# Every word an observation holds besides numbers and punctuation; the tiny policy's tokenizer
# (tasks.tiny_tokenizer) has each as one whole-word token.
VOCAB: tuple[str, ...] = tuple(dict.fromkeys((
    "hc pinn problem propose a boundary function as family and power families "
    "erank cond top modes of best common healthy collapsed invalid action reply "
    f"{' '.join(FAMILIES)} {' '.join(PROBLEMS)}"
).split()))
PUNCTUATION: tuple[str, ...] = (".", ",", ":", "/")


def spectrum(problem: str, spec: BoundarySpec, init_seed: int) -> Spectrum:
    """The residual kernel's spectrum of one HC-PINN at initialisation; computed afresh for
    every proposal, as an environment without a cache of its answers would."""
    return analyse(get_problem(problem), spec, init_seed)[0]


@functools.lru_cache(maxsize=64)
def reference(problem: str, init_seed: int) -> tuple[str, float]:
    """The commonly used boundary function with the highest effective rank on this problem and
    network, and that rank (cached per process: computed once per problem and seed)."""
    ranks = {c: spectrum(problem, parse_spec(c), init_seed).effective_rank for c in COMMON}
    best = max(ranks, key=ranks.__getitem__)
    return best, ranks[best]


def describe(s: Spectrum) -> str:
    """A spectrum in a few words: ``erank 1.74 / 64 cond 1e34 top 0.78 modes 2``."""
    cond = f"1e{s.log10_condition:.0f}" if s.log10_condition != float("inf") else "inf"
    return f"erank {s.effective_rank:.2f} / {s.n} cond {cond} top {s.top_share:.2f} " \
           f"modes {s.modes_90}"


class HCPinnDesign:
    """The boundary-function design task (see the module docstring)."""

    def __init__(self, problems: list[str] | tuple[str, ...] = tuple(PROBLEMS),
                 init_seeds: int = 4, max_turns: int = 3, tolerance: float = 0.15,
                 format_penalty: float = 0.1):
        self.check_config(problems=problems, init_seeds=init_seeds, max_turns=max_turns,
                          tolerance=tolerance)
        self.problems = tuple(problems)
        self.init_seeds = init_seeds
        self.max_turns = max_turns
        self.tolerance = tolerance
        self.format_penalty = format_penalty
        self._problem = self.problems[0]
        self._init_seed = 0
        self._turn = 0
        self._format_errors = 0
        self._proposals: list[dict[str, Any]] = []
        self._success = False

    @staticmethod
    def check_config(problems=tuple(PROBLEMS), init_seeds: int = 4, max_turns: int = 3,
                     tolerance: float = 0.15, **_) -> None:
        """Argument checks, run by the config loader without building an instance."""
        if isinstance(problems, str) or not problems:
            raise ValueError("problems must be a non-empty list of problem names")
        unknown = [p for p in problems if p not in PROBLEMS]
        if unknown:
            raise ValueError(f"unknown problems {unknown}; known: {sorted(PROBLEMS)}")
        if init_seeds < 1 or max_turns < 1:
            raise ValueError("init_seeds and max_turns must be at least 1")
        if not 0.0 <= tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self._problem = rng.choice(self.problems)
        self._init_seed = rng.randrange(self.init_seeds)
        self._turn, self._format_errors, self._success = 0, 0, False
        self._proposals = []
        best, rank = reference(self._problem, self._init_seed)
        obs = f"{INTRO.format(problem=self._problem)} . {HINT} . best common {best} : " \
              f"erank {rank:.2f}"
        return obs, self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._turn += 1
        spec = parse_spec(action)
        reward = 0.0
        if spec is None:
            self._format_errors += 1
            reward = -self.format_penalty
            obs = f"invalid action . reply family and power . {HINT}"
        else:
            s = spectrum(self._problem, spec, self._init_seed)
            _, ref_rank = reference(self._problem, self._init_seed)
            ratio = s.effective_rank / ref_rank
            self._success = ratio >= 1.0 - self.tolerance
            self._proposals.append({"spec": str(spec), "effective_rank": s.effective_rank,
                                    "log10_condition": s.log10_condition,
                                    "top_share": s.top_share, "modes_90": s.modes_90,
                                    "score": min(1.0, ratio)})
            reward = 1.0 if self._success else 0.0
            verdict = "healthy" if self._success else "collapsed"
            obs = f"{spec} : {describe(s)} : {verdict} , {ratio:.2f} of best common"
        terminated = self._success
        truncated = not terminated and self._turn >= self.max_turns
        return obs, reward, terminated, truncated, self._info() | {"format_error": spec is None}

    def _info(self) -> dict[str, Any]:
        # problem, seed and proposals let a verifier train the final proposal (tasks.hc_pinn)
        last = self._proposals[-1] if self._proposals else None
        return {"success": self._success, "format_errors": self._format_errors,
                "turns": self._turn, "problem": self._problem, "init_seed": self._init_seed,
                "proposals": list(self._proposals), "spec": last["spec"] if last else None,
                "tolerance": self.tolerance, "format_penalty": self.format_penalty}

    def close(self) -> None:
        pass
