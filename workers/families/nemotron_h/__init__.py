"""Nemotron-H: a hybrid of Mamba2 mixers, a few attention layers and latent MoE layers. Each MoE block projects
tokens down to `moe_latent_size` (fc1_latent_proj), routes them to plain MLP experts (up_proj, relu², down_proj;
no gate) and projects back (fc2_latent_proj), beside a shared expert. Expert parallelism replaces the experts
module only, so tokens travel the all-to-all at latent width. The Mamba2 layers run transformers' own code."""
