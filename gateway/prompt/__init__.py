"""The prompt stage: render a chat request with the model's template, tokenize it, tag every token."""
