"""Judging a job beyond its training loss: the precision alignment of its swapped operators at job start."""
