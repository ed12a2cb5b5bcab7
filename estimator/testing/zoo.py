"""The test zoo: small but real models, each as (model factory, batch factory, loss)."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _image_batch(channels: int, size: int, classes: int):
    def make(b, device):
        return torch.empty(b, channels, size, size, device=device), torch.zeros(b, dtype=torch.long, device=device)
    return make


def _ce(out, target):
    return F.cross_entropy(out, target)


def _torchvision(name: str, size: int, **kwargs):
    import torchvision

    factory = functools.partial(getattr(torchvision.models, name), num_classes=10, **kwargs)
    return factory, _image_batch(3, size, 10), _ce


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))  # (B, T, 64)
        return self.head(h[:, -1])


class TiedLM(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 500, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))  # (B, T, 500)


class InPlaceNet(nn.Module):
    """In-place activations, an in-place add into a view, and a residual +=."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 64)
        self.norm = nn.LayerNorm(64)

    def forward(self, x):
        h = F.relu(self.a(x), inplace=True)  # addmm does not save its output
        g = h.clone()
        g[:, :32].mul_(2.0)  # in place on a view: CopySlices
        y = self.b(g)
        y += x
        return self.norm(y).sigmoid_()


class InPlaceOnViewNet(nn.Module):
    """Swin V2's continuous position bias MLP: Linear on a 4-D input returns a view,
    and ReLU(inplace=True) on it saves its output through CopySlices."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, 64), nn.ReLU(inplace=True), nn.Linear(64, 4))
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):  # x: (B, 8, 8, 2)
        return self.head(self.mlp(x).flatten(1))


class CheckpointedMLP(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3))
        self.head = nn.Linear(64, 10)
        self.reentrant = reentrant

    def forward(self, x):
        for blk in self.blocks:
            x = x + checkpoint(blk, x, use_reentrant=self.reentrant)
        return self.head(x)


def _tokens(vocab: int, seq: int):
    def make(b, device):
        ids = torch.zeros(b, seq, dtype=torch.long, device=device)
        return ids, ids
    return make


def _lm_loss(out, target):
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64)
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


class _GPTBlock(nn.Module):
    """A GPT-2 block with bias-free Linears (as Llama's): its four matmuls reach ``aten.mm``."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MiniGPT(nn.Module):
    """A GPT-2-style LM outside transformers: token and position embeddings, a ModuleList of blocks, a head."""

    def __init__(self, vocab: int = 1000, seq: int = 32, d: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_GPTBlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=256,
                     vocab_size=1000, max_position_embeddings=64, num_labels=2)
    cfg._attn_implementation = "eager"
    return BertForSequenceClassification(cfg)


def _bert_batch(b, device):
    ids = torch.zeros(b, 32, dtype=torch.long, device=device)
    return {"input_ids": ids}, torch.zeros(b, dtype=torch.long, device=device)


def _seqcls_loss(out, target):
    return F.cross_entropy(out.logits, target)


def _mlp_batch(b, device):
    return torch.empty(b, 64, device=device), torch.zeros(b, dtype=torch.long, device=device)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))  # (B, 8, 16, 16) -> (B, 2048) -> (B, 10)


ZOO = {
    "mlp": (MLP, lambda b, d: (torch.empty(b, 256, device=d), torch.zeros(b, dtype=torch.long, device=d)), _ce),
    "conv": (ConvNet, _image_batch(3, 16, 10), _ce),
    "resnet18": _torchvision("resnet18", 64),
    "resnet50": _torchvision("resnet50", 64),
    "vit_b_16": _torchvision("vit_b_16", 224),
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small", 64),
    "lstm": (LSTMClassifier, lambda b, d: (torch.zeros(b, 12, dtype=torch.long, device=d),
                                           torch.zeros(b, dtype=torch.long, device=d)), _ce),
    "gpt2": (_gpt2, _tokens(1000, 32), _lm_loss),
    "bert": (_bert, _bert_batch, _seqcls_loss),
    "minigpt": (MiniGPT, _tokens(1000, 32), _lm_loss),
    "tied": (TiedLM, _tokens(500, 16), _lm_loss),
    "inplace": (InPlaceNet, lambda b, d: (torch.empty(b, 64, device=d), torch.empty(b, 64, device=d)),
                lambda out, t: F.mse_loss(out, t)),
    "inplace_view": (InPlaceOnViewNet, lambda b, d: (torch.empty(b, 8, 8, 2, device=d),
                                                     torch.zeros(b, dtype=torch.long, device=d)), _ce),
    "checkpoint": (functools.partial(CheckpointedMLP, False), _mlp_batch, _ce),
    "checkpoint_reentrant": (functools.partial(CheckpointedMLP, True), _mlp_batch, _ce),
}
