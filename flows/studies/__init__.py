"""Studies run on the cluster beside training: their sweeps (which jobs, submitted how, every
failure recorded) and their reports (tables, figures, result files). Their entry points sit at
the top of ``flows/`` (``flows/hc_pinn_study.py``); the science they run is in ``tasks/``."""
