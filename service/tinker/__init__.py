"""Tinker's protocol (the `tinker` SDK, tinker-cookbook's loops) on moetune's training sessions: routes.py."""
