"""Integrations of strata with other libraries' training loops.

strata.integrations.transformers: Hugging Face Trainer and TrainingArguments subclasses that
train through strata.initialize instead of DeepSpeed (imports transformers).
strata.integrations.accelerate: accelerate's Accelerator whose DeepSpeed plugin trains through
strata.initialize (imports accelerate).
"""
