"""Multi-turn text environments following the GEM text-environment API."""
