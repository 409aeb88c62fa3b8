"""The LoGo decoder: backbone, attention kinds, the LoGo layer, its budget controller, and accounting."""
from logo.model.controller import BudgetController
from logo.model.transformer import ModelOutput, Transformer, TransformerBlock

__all__ = ["Transformer", "TransformerBlock", "ModelOutput", "BudgetController"]
