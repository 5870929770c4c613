"""The embedded local stack, all on loopback: an S3-compatible server, a Ray head and the control plane; `moetune
demo` (the whole path end to end) and `moetune up` / `down` (the stack kept between commands). The test suite runs
on the same parts."""
