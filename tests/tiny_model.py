"""A tiny Llama model and a byte-level BPE tokenizer with a chat template, built locally.

Tests use it instead of a hub model: it loads through the same `from_pretrained` path as a real
model folder, in well under a second.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and m['role'] == 'assistant' and not add_generation_prompt) %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The capital of France is Paris. The capital of Kenya is Nairobi.",
    "What is 2 + 3? The answer is 5. <answer>Paris</answer> <search>capital</search>",
    "e2e4 e7e5 g1f3 b8c6 f1c4 d8h4 Qxf7# checkmate legal moves",
    "def run(env, llm): return llm([{'role': 'user', 'content': env.question}])",
    "0123456789 + - * / = ( ) { } [ ] boxed answer question system user assistant",
]


def build_tiny_model(path: str | Path, vocab_size: int = 384, seed: int = 0) -> Path:
    """Write a random tiny Llama causal LM + tokenizer to `path` and return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(path)
    return path
