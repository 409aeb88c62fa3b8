"""Hugging Face config of an exported logo model (model_type "logo"; loads with trust_remote_code=True).

Written by `python -m logo.export`; self-contained (no `logo` import). Besides the Llama-style shape it holds,
per layer, the attention kind and, for LoGo layers, the budget threshold frozen from the checkpoint.
"""
from transformers import PretrainedConfig

LAYER_KINDS = ("full", "local", "intra_layer", "logo")


class LogoConfig(PretrainedConfig):
    model_type = "logo"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=100352, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, head_dim=None, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=512, layer_kinds=None, window=128, num_global_heads=0,
                 transform="lp", context_norm=True, fusion="weighted", thresholds=None,
                 tie_word_embeddings=False, logo=None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads  # multi-head attention only
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        # Per layer: full | local | intra_layer | logo; the LoGo threshold b (None for other layers).
        self.layer_kinds = list(layer_kinds or ["logo"] * num_hidden_layers)
        self.window = window  # sliding-window span of local branches and local heads
        self.num_global_heads = num_global_heads  # intra_layer: the first heads attend the full context
        self.transform = transform  # LoGo branch transform: lp | so | shared | full
        self.context_norm = context_norm
        self.fusion = fusion  # weighted | additive
        self.thresholds = list(thresholds or [None] * num_hidden_layers)
        self.logo = logo or {}  # provenance: the run's attention config, training step, project version
        bad = [k for k in self.layer_kinds if k not in LAYER_KINDS]
        if len(self.layer_kinds) != num_hidden_layers or bad:
            raise ValueError(f"invalid layer_kinds {self.layer_kinds}: need {num_hidden_layers} of {LAYER_KINDS}")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
