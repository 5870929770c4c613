"""The collectives the workers run themselves, held to NCCL's rules on every backend (`checked`), the same-host
all-to-all of gloo groups (`local_exchange`), the check that ranks run the same ZeRO-3 modules in the same order
(`lockstep`), and the context-parallel exchanges: a differentiable all-gather (`differentiable`), KDA's state passed
between the ranks of a sequence (`kda_context`) and the short convolution's halo (`conv_halo`)."""
