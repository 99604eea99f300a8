"""The matrix's random-circuit control at equal cost: 20 draws x 200 prompts (before) against 100 draws x 40
prompts (the default now), by simulation: how often the circuit's rank p resolves 0.05 and 0.01, and the width of
the draws' interval (resampling draws and prompts). Draw d's chance on prompt i: logistic(a_d + b_i), a_d ~ N(mu,
s_a) (draws differ), b_i ~ N(0, s_b) (prompts differ, shared by every draw and the circuit); the circuit's:
logistic(a_c + b_i). Scenarios from the committed entity-tracking study and the issue's wide-draws case.

    PYTHONPATH=. python benchmarks/random_controls.py [studies per design, default 200]
"""

import sys

import numpy as np
from scipy.special import expit, logit

from mechdiff.common import inference as inf


def one(rng, n_draws, n_prompts, mu, s_a, a_c, s_b=1.0):
    b = rng.normal(0, s_b, n_prompts)
    draws = (rng.random((n_draws, n_prompts)) < expit(rng.normal(mu, s_a, (n_draws, 1)) + b)).astype(float)
    circ = (rng.random(n_prompts) < expit(a_c + b)).astype(float)
    r = inf.control_rank(circ, draws, seed=int(rng.integers(1 << 30)))
    return r.p, r.draws.high - r.draws.low


scenarios = {  # name: (draws' mean accuracy, spread s_a on the logit scale, circuit's accuracy)
    "entity tracking, early (draws 0.17, 0.08-0.32 of 20; circuit 0.54)": (0.17, 0.47, 0.54),
    "circuit just above most draws (circuit 0.30)": (0.17, 0.47, 0.30),
    "no better than the draws (circuit 0.17)": (0.17, 0.47, 0.17),
    "wide draws (0.63, 0.04-0.93 of 20; circuit 0.93)": (0.63, 1.6, 0.93),
}
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
rng = np.random.default_rng(0)
print(f"{reps} simulated studies each; p = rank p (+1 corrected); width = the draws' 95% interval (draws and prompts)")
for name, (m, s_a, c) in scenarios.items():
    print(name)
    for n_draws, n_prompts in ((20, 200), (100, 40)):
        out = np.array([one(rng, n_draws, n_prompts, logit(m), s_a, logit(c)) for _ in range(reps)])
        print(
            f"  {n_draws:3d} draws x {n_prompts:3d} prompts: P(p <= 0.05) {np.mean(out[:, 0] <= 0.05):.2f}, "
            f"P(p <= 0.01) {np.mean(out[:, 0] <= 0.0101):.2f}, median p {np.median(out[:, 0]):.3f}, "
            f"mean width {out[:, 1].mean():.3f}"
        )
