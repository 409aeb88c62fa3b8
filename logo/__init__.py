"""logo: LoGo attention pretraining. `logo.load_pretrained(PATH)` loads a trained model in one call."""


def __getattr__(name):  # lazy: `import logo.config` (and every subpackage import) stays free of torch
    if name == "load_pretrained":
        from logo.run.load import load_model
        return load_model
    raise AttributeError(f"module 'logo' has no attribute {name!r}")
