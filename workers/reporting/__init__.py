"""What a job tells the outside: reports to the control plane, Prometheus metrics (node, process, MoE expert load),
each step's figures, and the adaptation report (report.json + a self-contained report.html)."""
