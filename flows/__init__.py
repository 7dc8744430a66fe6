"""Runnable entry points and the wiring between tasks."""
