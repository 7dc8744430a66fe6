"""The HC-PINN library (tasks.hc_pinn), the hc_pinn env task and its two rewards: the residual
kernel against finite differences, boundary functions and trial functions on the boundary, the
problems against their exact solutions, effective rank, training that converges or collapses,
the environment, and the verification function through the Lambda emulation with real boto3."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from resources.lambda_client import LambdaRewardClient
from resources.lambda_emulator import FunctionSpec, LambdaEmulator
from resources.lambda_template import DEFAULT_TEMPLATE, function_specs, load_sam_template
from tasks.envs.hc_pinn import HCPinnDesign, reference
from tasks.hc_pinn.boundary import COMMON, boundary_function, grammar
from tasks.hc_pinn.grammar import BoundarySpec, parse_spec
from tasks.hc_pinn.ntk import (
    HCPinn,
    condition_number,
    effective_rank,
    eigenvalues,
    make_network,
    residual_ntk,
)
from tasks.hc_pinn.problems import PROBLEMS, get_problem
from tasks.hc_pinn.training import train
from tasks.hc_pinn.verify import SUCCESS_LOSS, hc_pinn_convergence
from tasks.records import ScoreRequest
from tasks.rewards import hc_pinn_spectral
from tests.episodes import play

PROBLEM_NAMES = sorted(PROBLEMS)


@pytest.mark.parametrize("name", PROBLEM_NAMES)
def test_kernel_matches_finite_differences(name):
    problem = get_problem(name)
    pinn = HCPinn(problem, BoundarySpec("sine", 2), make_network(problem.dim, 3, width=4, depth=1))
    xs = problem.collocation(3)[:6]
    params = pinn.params()
    kernel = residual_ntk(pinn, xs)
    # central differences of the batched residual (reverse mode over the points), one
    # parameter entry at a time: an independent route to J
    eps, columns = 1e-6, []
    for key, value in params.items():
        for i in range(value.numel()):
            cols = []
            for sign in (1.0, -1.0):
                shifted = dict(params)
                bumped = value.clone().reshape(-1)
                bumped[i] += sign * eps
                shifted[key] = bumped.reshape(value.shape)
                cols.append(pinn.residuals(shifted, xs).detach())
            columns.append((cols[0] - cols[1]) / (2 * eps))
    jac_fd = torch.stack(columns, dim=1)
    torch.testing.assert_close(kernel, jac_fd @ jac_fd.T, rtol=1e-6, atol=1e-8 * kernel.abs().max())
    # and the per-point residual of torch.func equals the batched one
    torch.testing.assert_close(torch.stack([pinn.residual_at(params, x) for x in xs]),
                               pinn.residuals(params, xs).detach())


@pytest.mark.parametrize("name", PROBLEM_NAMES)
def test_every_boundary_function_vanishes_on_the_boundary_and_the_trial_meets_it(name):
    problem = get_problem(name)
    boundary, inside = problem.boundary_points(), problem.collocation()
    network = make_network(problem.dim, 0)
    for spec in grammar():
        b = boundary_function(spec, problem)
        assert float(b(boundary).abs().max()) < 1e-12, spec
        assert float(b(inside).min()) > 0.0, spec  # and nowhere inside
        pinn = HCPinn(problem, spec, network)
        with torch.no_grad():
            u = pinn.predict(pinn.params(), boundary)
        torch.testing.assert_close(u, problem.exact(boundary), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", PROBLEM_NAMES)
def test_the_exact_solution_has_zero_residual(name):
    problem = get_problem(name)
    xs = problem.collocation().requires_grad_(True)
    u = problem.exact(xs)
    (grad,) = torch.autograd.grad(u.sum(), xs, create_graph=True)
    hess = torch.stack([torch.autograd.grad(grad[:, i].sum(), xs, retain_graph=True)[0]
                        for i in range(problem.dim)], dim=1)
    assert float(problem.residual(xs, u, grad, hess).detach().abs().max()) < 1e-9


def test_effective_rank_and_condition_number():
    n = 7
    assert effective_rank(eigenvalues(torch.eye(n, dtype=torch.float64))) == pytest.approx(n)
    v = torch.randn(n, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert effective_rank(eigenvalues(v @ v.T)) == pytest.approx(1.0, abs=1e-9)
    # two equal eigenvalues: 2; a scale leaves it unchanged
    assert effective_rank(torch.tensor([3.0, 3.0, 0.0])) == pytest.approx(2.0)
    assert effective_rank(torch.tensor([5.0, 1.0])) == effective_rank(torch.tensor([50.0, 10.0]))
    assert effective_rank(torch.zeros(3)) == 0.0
    assert condition_number(torch.tensor([4.0, 2.0, 0.5])) == 8.0
    assert condition_number(torch.tensor([1.0, 0.0])) == math.inf


def test_grammar_parses_and_refuses():
    assert parse_spec("sine 2") == BoundarySpec("sine", 2)
    assert parse_spec("I pick RFUN") == BoundarySpec("rfun", 1)
    assert parse_spec("exp 32 please") == BoundarySpec("exp", 32)
    for bad in ("", "sine 9", "exp 33", "poly 0", "sinus 2", "x" * 300, None):
        assert parse_spec(bad) is None, bad
    assert len(grammar()) == len(set(grammar())) and all(parse_spec(c) for c in COMMON)


def test_a_collapsing_boundary_function_stagnates_where_a_healthy_one_converges():
    problem = get_problem("poisson1d")
    healthy = train(problem, BoundarySpec("poly", 1), 0, max_steps=400, threshold=1e-2)
    collapsed = train(problem, BoundarySpec("sine", 4), 0, max_steps=400, threshold=1e-2)
    assert healthy.reached and healthy.steps < 400 and healthy.l2_error < 0.15
    assert not collapsed.reached and collapsed.final_loss > 0.3 and collapsed.l2_error > 0.5
    assert healthy.loss_curve[0] == pytest.approx(collapsed.loss_curve[0], rel=0.5)


def _episode(env, seed, actions) -> dict:
    env.reset(seed=seed)
    return play(env, actions)


def test_environment_scores_proposals_against_the_best_common_form():
    env = HCPinnDesign(problems=["poisson1d"], init_seeds=1, max_turns=3)
    obs, info = env.reset(seed=0)
    best, rank = reference("poisson1d", 0)
    assert "poisson1d" in obs and best in obs and info["problem"] == "poisson1d"
    item = _episode(env, 0, ["nonsense", "sine 4", "poly 1"])
    rewards, info = item["env_rewards"], item["info"]
    assert rewards == [pytest.approx(-0.1), 0.0, 1.0]
    assert [p["spec"] for p in info["proposals"]] == ["sine 4", "poly 1"]
    assert info["proposals"][0]["effective_rank"] < 0.85 * rank <= info["proposals"][1][
        "effective_rank"] / 0.85
    assert info["format_errors"] == 1 and info["success"] and info["spec"] == "poly 1"
    # the rule-based reward re-parses the replies and reads the environment's spectrum
    score, details = hc_pinn_spectral(item)
    assert details["success"] and details["agrees_with_env"] and details["spec"] == "poly 1"
    assert score == pytest.approx(info["proposals"][-1]["score"] - 0.1)
    with pytest.raises(ValueError, match="environment scored"):
        hc_pinn_spectral(item | {"responses": ["nonsense", "sine 4", "poly 2"]})
    # a spent episode without success
    info = _episode(env, 1, ["sine 4", "sine 4", "poly 4"])["info"]
    assert not info["success"] and info["turns"] == 3


def test_environment_rejects_bad_arguments():
    for kwargs in ({"problems": ["poisson3d"]}, {"problems": "poisson1d"}, {"init_seeds": 0},
                   {"tolerance": 1.0}):
        with pytest.raises(ValueError):
            HCPinnDesign.check_config(**kwargs)


def test_verification_reward_trains_the_last_valid_proposal():
    info = {"problem": "poisson1d", "init_seed": 0, "format_penalty": 0.1, "success": True}
    good, details = hc_pinn_convergence({"responses": ["sine 4", "huh", "poly 1"], "info": info})
    assert details["spec"] == "poly 1" and details["success"] and details["agrees_with_env"]
    assert details["final_loss"] <= SUCCESS_LOSS and details["format_errors"] == 1
    bad, details = hc_pinn_convergence({"responses": ["sine 4"], "info": info})
    assert not details["success"] and not details["agrees_with_env"] and bad < good - 0.3
    assert hc_pinn_convergence({"responses": ["?"], "info": info})[0] == pytest.approx(-0.1)


def test_verification_runs_on_its_own_lambda_function_through_the_emulation():
    """The template's rollarc-reward-pinn, run by the emulation, called with real boto3: its
    allow-list admits the verifier, and the zip function's refuses it."""
    spec = function_specs(load_sam_template(DEFAULT_TEMPLATE))["rollarc-reward-pinn"]
    pinn = FunctionSpec("rollarc-reward-pinn", spec["handler"], spec["timeout_s"],
                        spec["memory_mb"], spec["environment"])
    rule_spec = function_specs(load_sam_template(DEFAULT_TEMPLATE))["rollarc-reward"]
    rule = FunctionSpec("rollarc-reward", rule_spec["handler"], rule_spec["timeout_s"],
                        rule_spec["memory_mb"], rule_spec["environment"])
    env = HCPinnDesign(problems=["poisson1d"], init_seeds=1)
    reqs = []
    for i, actions in enumerate((["poly 1"], ["sine 4", "sine 4", "sine 4"])):
        item = _episode(env, i, actions)
        reqs.append(ScoreRequest(id=str(i), idempotency_key=f"pinn/{i}", env_name="hc_pinn",
                                 reward_fn="tasks.hc_pinn.verify.hc_pinn_convergence",
                                 env_rewards=item["env_rewards"], responses=item["responses"],
                                 info=item["info"]))
    with LambdaEmulator([pinn, rule], concurrency=1) as em:
        client = LambdaRewardClient("rollarc-reward-pinn", endpoint_url=em.url,
                                    dummy_credentials=True, concurrency=1, min_batch=2)
        batch = client.score(reqs)
        good, bad = batch.results
        assert good.error is None and bad.error is None
        assert good.details["success"] and not bad.details["success"]
        assert good.score > bad.score + 0.3 and good.details["spec"] == "poly 1"
        refused = LambdaRewardClient("rollarc-reward", endpoint_url=em.url,
                                     dummy_credentials=True, concurrency=1).score(reqs[:1])
        assert "allowed modules" in refused.results[0].error


def test_environments_on_threads_of_one_process_compute_kernels_safely():
    """An env worker steps many environments on threads of one process, and torch.func's
    forward-mode state is process-wide: kernels computed at once must not corrupt each other."""
    errors: list[str] = []
    spectra: dict[int, list[float]] = {}

    def episode(i):
        try:
            env = HCPinnDesign(problems=["poisson1d", "heat1d"], init_seeds=1)
            env.reset(seed=i)
            spectra[i] = [env.step(a)[4]["proposals"][-1]["effective_rank"]
                          for a in ("sine 2", "exp 4")]
        except Exception as exc:  # collected: an exception in a thread would pass unseen
            errors.append(repr(exc))

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(spectra) == 12
    alone = HCPinnDesign(problems=["poisson1d", "heat1d"], init_seeds=1)
    alone.reset(seed=0)
    assert alone.step("sine 2")[4]["proposals"][-1]["effective_rank"] == pytest.approx(
        spectra[0][0], rel=1e-9)
