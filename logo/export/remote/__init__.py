"""The self-contained Hugging Face remote code copied into every non-full-attention export (trust_remote_code).

These two files import nothing from `logo`: an exported folder must load where only `transformers` is installed.
"""
