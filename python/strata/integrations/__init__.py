"""Integrations of strata with other libraries' training loops.

strata.integrations.transformers: Hugging Face Trainer and TrainingArguments subclasses that
train through strata.initialize instead of DeepSpeed (imports transformers).
"""
