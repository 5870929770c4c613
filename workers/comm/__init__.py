"""The collectives the workers run themselves, held to NCCL's rules on every backend (`checked`), the same-host
all-to-all of gloo groups (`local_exchange`), and the check that ranks run the same ZeRO-3 modules in the same order
(`lockstep`)."""
