"""Hard-constrained physics-informed neural networks (HC-PINNs) and the spectra of their
residual neural tangent kernels: the library behind the ``hc_pinn`` env task.

- :mod:`tasks.hc_pinn.problems`: PDE problems with exact solutions;
- :mod:`tasks.hc_pinn.boundary`: boundary functions ``B`` and the grammar naming them;
- :mod:`tasks.hc_pinn.ntk`: the trial function ``A + B N``, the residual kernel, its spectrum;
- :mod:`tasks.hc_pinn.training`: training an HC-PINN to a loss threshold within a step budget.
"""
