"""Hard-constrained physics-informed neural networks (HC-PINNs) and the spectra of their
residual neural tangent kernels: the library behind the ``hc_pinn`` env task.

- :mod:`tasks.hc_pinn.problems`: PDE problems with exact solutions;
- :mod:`tasks.hc_pinn.grammar`: the words that name a boundary function (torch-free);
- :mod:`tasks.hc_pinn.boundary`: the boundary functions ``B`` themselves;
- :mod:`tasks.hc_pinn.ntk`: the trial function ``A + B N``, the residual kernel, its spectrum;
- :mod:`tasks.hc_pinn.training`: training an HC-PINN to a loss threshold within a step budget;
- :mod:`tasks.hc_pinn.verify`: the reward that trains an agent's proposal (a Lambda function);
- :mod:`tasks.hc_pinn.study`: the spectral study's job;
- :mod:`tasks.hc_pinn.correlations`: its statistics, Spearman's rho and the verdict (torch-free);
- :mod:`tasks.hc_pinn.collapse`: its collapse rule and per-``B`` summaries (torch-free).
"""
