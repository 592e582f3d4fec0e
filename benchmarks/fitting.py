"""Nelder-Mead minimisation (numpy only), shared by the accuracy benchmarks."""
from __future__ import annotations

import numpy as np


def nelder_mead(f, x0: np.ndarray, step: float = 0.3, iters: int = 400, tol: float = 1e-5,
                relative: bool = False) -> np.ndarray:
    """Minimise f from x0 (Nelder and Mead 1965, standard coefficients). The first simplex steps
    each coordinate by `step` (absolute), or with `relative` by that fraction of its value."""
    eye = np.eye(len(x0))
    if relative:
        simplex = [x0] + [x0 * (1 + step * eye[i]) + step * 0.01 * eye[i] for i in range(len(x0))]
    else:
        simplex = [x0] + [x0 + step * eye[i] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (s - simplex[0]) for s in simplex[1:]]
                values = [values[0]] + [f(s) for s in simplex[1:]]
    return simplex[int(np.argmin(values))]
