def tiny_config(**overrides):
    """Its text model is the tiny config of the family of the text model transformers nests (DeepSeek-V3's)."""
    from transformers import Kimi_K25Config

    from moetune.workers.families.registry import family_for

    text = family_for(Kimi_K25Config().text_config).tiny_config(**overrides)
    vision = {"patch_size": 4, "pos_emb_height": 4, "pos_emb_width": 4, "num_attention_heads": 2,
              "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
    return Kimi_K25Config(text_config=text.to_dict(), vision_config=vision, projection_hidden_size=32,
                          tie_word_embeddings=False)
