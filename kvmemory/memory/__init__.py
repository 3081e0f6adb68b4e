"""The memory facade (`KVMemory`): remember, recall, answer, verify; its prompts and verifiers."""
