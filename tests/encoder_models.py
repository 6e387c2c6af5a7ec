"""Tiny random BERT-style encoders (BERT, RoBERTa, XLM-RoBERTa, ModernBERT) with small real tokenizers built here
(BERT's WordPiece; XLM-R's Unigram, which the RoBERTa model reads too: it shares XLM-R's special tokens and pair
template; ModernBERT's byte-level BPE), saved as transformers and sentence-transformers save them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    BertTokenizerFast,
    PreTrainedTokenizerFast,
    XLMRobertaTokenizerFast,
)

from tests.conftest import CORPUS
from tests.pooling_models import ST_MODES

MAX_POSITIONS = 256
_SPECIAL = {"bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "xlm-roberta": ["<s>", "<pad>", "</s>", "<unk>"]}
# ModernBERT's sliding layers see 4 positions either side (local_attention 8), so the tests' prompts pass the window;
# every other layer is global.
MODERNBERT = dict(local_attention=8, global_attn_every_n_layers=2, num_hidden_layers=3)


def bert_tokenizer() -> BertTokenizerFast:
    """WordPiece over the corpus' lower-cased words, with single characters and their `##` pieces for the rest."""
    words = {word for line in CORPUS for word, _ in pre_tokenizers.BertPreTokenizer().pre_tokenize_str(line.lower())}
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    tokens = _SPECIAL["bert"] + list(chars) + [f"##{c}" for c in chars] + sorted(words)
    return BertTokenizerFast(vocab={token: i for i, token in enumerate(dict.fromkeys(tokens))})


def xlm_roberta_tokenizer() -> XLMRobertaTokenizerFast:
    """A Unigram (SentencePiece-style) tokenizer with XLM-R's special tokens, ids and pair template."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=_SPECIAL["xlm-roberta"], unk_token="<unk>")
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", pad_token="<pad>")
    return XLMRobertaTokenizerFast(tokenizer_object=tok, unk_token="<unk>", mask_token="<unk>", **names)


def modernbert_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with ModernBERT's [CLS] ... [SEP] template and no token types, as its tokenizer has."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = _SPECIAL["bert"]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    names = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=["input_ids", "attention_mask"], **names)


def _tokenizer(family: str) -> PreTrainedTokenizerFast:
    if family == "bert":
        return bert_tokenizer()
    return modernbert_tokenizer() if family == "modernbert" else xlm_roberta_tokenizer()


def save_encoder(folder: Path, family: str, num_labels: int = 0, seed: int = 0, **config) -> Path:
    """A tiny random `BertModel` / `RobertaModel` / `XLMRobertaModel` (with `num_labels`, its
    `*ForSequenceClassification`) and its tokenizer; RoBERTa numbers positions from pad_token_id + 1, so it has 2
    more position rows. `config` goes into the model's config (ModernBERT's `classifier_pooling`, say)."""
    tokenizer = _tokenizer(family)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=MAX_POSITIONS + (2 if family in ("roberta", "xlm-roberta") else 0),
        initializer_range=0.3,
        pad_token_id=tokenizer.pad_token_id,
    )
    if family == "modernbert":
        ids = {name: getattr(tokenizer, f"{name}_id") for name in ("cls_token", "sep_token", "pad_token")}
        settings |= MODERNBERT | {"cls_token_id": ids["cls_token"], "sep_token_id": ids["sep_token"]}
        settings |= dict(bos_token_id=ids["cls_token"], eos_token_id=ids["sep_token"], norm_bias=True)
    elif family != "bert":  # RoBERTa's and XLM-R's one token type
        settings |= dict(type_vocab_size=1, bos_token_id=0, eos_token_id=2)
    settings |= config
    if num_labels:
        settings["num_labels"] = num_labels
    torch.manual_seed(seed)
    model_class = AutoModelForSequenceClassification if num_labels else AutoModel
    model = model_class.from_config(AutoConfig.for_model(family, **settings), dtype=torch.float32)
    with torch.no_grad():  # LayerNorms start at weight 1, bias 0; random ones tell them apart
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    tokenizer.model_max_length = MAX_POSITIONS
    tokenizer.save_pretrained(folder)
    return folder


def save_st_encoder(folder: Path, family: str, pooling: str, normalize: bool = True, **config) -> Path:
    """`save_encoder`'s bare model with sentence-transformers' modules: Transformer, Pooling, optional Normalize."""
    save_encoder(folder, family, **config)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    (folder / "1_Pooling").mkdir()
    settings = {mode: False for mode in ST_MODES.values()} | {ST_MODES[pooling]: True, "word_embedding_dimension": 64}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_POSITIONS}))
    return folder
