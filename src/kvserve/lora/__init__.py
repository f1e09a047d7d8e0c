"""LoRA adapters: PEFT loading, the registry of resident slots, and the grouped low-rank update."""
