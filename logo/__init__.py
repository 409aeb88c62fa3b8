"""logo: LoGo attention pretraining. `logo.load_pretrained(PATH)` loads a trained model in one call."""


def __getattr__(name):  # lazy: `import logo.config` stays light and import cycles stay impossible
    if name == "load_pretrained":
        from logo.eval.load import load_model
        return load_model
    raise AttributeError(f"module 'logo' has no attribute {name!r}")
