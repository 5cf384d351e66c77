"""clone: the same deep copy as copy.deepcopy, made faster for modules that copy the plain way."""
import copy

import torch
from torch import nn
from torch.nn.utils import prune

from autotune.clone import clone, clone_sharing_weights


class Tied(nn.Module):
    """Two children sharing one weight, a buffer, a plain attribute and a list holding a tensor."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = nn.Linear(6, 6), nn.Linear(6, 6)
        self.decoder.weight = self.encoder.weight
        self.register_buffer("scale", torch.tensor(2.0))
        self.note = {"kept": [1, 2]}
        self.extras = [torch.ones(3)]

    def forward(self, x):
        return self.decoder(self.encoder(x)) * self.scale + self.extras[0].sum()


def tensors(module):
    return [t for t in list(module.parameters()) + list(module.buffers())]


def test_clone_gives_what_deepcopy_gives_and_shares_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(Tied(), nn.BatchNorm1d(6), nn.MultiheadAttention(6, 2, batch_first=True)).eval()
    model[0].encoder.register_forward_hook(lambda module, args, out: out + 1)
    x = torch.randn(4, 6)
    twin, reference = clone(model), copy.deepcopy(model)
    with torch.inference_mode():
        assert torch.equal(twin[0](x), reference[0](x)) and torch.equal(twin[0](x), model[0](x))
        assert torch.equal(twin[1](x), model[1](x))
        q = x.unsqueeze(0)
        assert torch.equal(twin[2](q, q, q)[0], model[2](q, q, q)[0])   # MultiheadAttention: its own __setstate__
    assert twin.state_dict().keys() == model.state_dict().keys()
    assert twin[0].decoder.weight is twin[0].encoder.weight                # ties kept
    assert not {id(t) for t in tensors(twin)} & {id(t) for t in tensors(model)}
    assert twin[0].extras[0] is not model[0].extras[0] and twin[0].note == model[0].note
    assert twin[0].note is not model[0].note
    twin[0].encoder.register_forward_hook(lambda module, args, out: out * 0)
    assert len(model[0].encoder._forward_hooks) == 1 and len(twin[0].encoder._forward_hooks) == 2


def test_a_memo_entry_stands_in_for_its_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    stand_in = nn.Identity()
    twin = clone(model, memo={id(model[2]): stand_in})
    assert twin[2] is stand_in and isinstance(twin[0], nn.Linear) and twin[0] is not model[0]


class SaveOutput:
    """A forward hook object collecting what a module returns (the usual way to take features from a layer)."""

    def __init__(self):
        self.outputs = []

    def __call__(self, module, args, out):
        self.outputs.append(out)


class CountsItsCalls(nn.Linear):
    """A module registering a method of its own as its forward hook (a library's pattern)."""

    def __init__(self):
        super().__init__(4, 4)
        self.calls = 0
        self.register_forward_hook(self._count)

    def _count(self, module, args, out):
        self.calls += 1


def test_a_copy_runs_the_users_hook_objects_themselves_and_its_own_methods_rebound():
    model = nn.Sequential(nn.Linear(4, 4), CountsItsCalls())
    save = SaveOutput()
    model[0].register_forward_hook(save)
    twin = clone(model)
    with torch.inference_mode():
        twin(torch.randn(2, 4))
    assert len(save.outputs) == 1            # the user's collector, not a copy of it, got the copy's call
    assert twin[1].calls == 1 and model[1].calls == 0    # the module's own hook counted on the copy


def test_a_weight_computed_with_autograd_on_is_copied_by_its_value():
    """Right after `prune.l1_unstructured` (or a forward with gradients) the pruned module's `weight` is a tensor
    computed from `weight_orig * weight_mask`, which deepcopy refuses ("Only Tensors created explicitly by the
    user (graph leaves) support the deepcopy protocol"): autotune failed on such a model before its first call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    assert not model[0].weight.is_leaf
    twin = clone(model)
    assert twin[0].weight.is_leaf and torch.equal(twin[0].weight, model[0].weight)
    twin[0].weight_mask.fill_(0.0)   # its prune hook recomputes the weight from the copy's own parts
    x = torch.randn(3, 6)
    with torch.no_grad():
        assert torch.equal(twin(x), model[2](torch.relu(torch.zeros(3, 8) + model[0].bias)))
        assert not torch.equal(model(x), twin(x))


def test_a_copy_sharing_weights_holds_the_same_parameters_and_buffers_of_its_own():
    """The signals' working copy of a big model no longer costs its weights again: its modules are its own (a module
    replaced in it is not replaced in the original), its parameters the original's, tied ones still tied."""
    torch.manual_seed(0)
    original = Tied()
    copied = clone_sharing_weights(original)
    assert copied.encoder is not original.encoder and copied.encoder.weight is original.encoder.weight
    assert copied.decoder.weight is copied.encoder.weight and copied.encoder.bias is original.encoder.bias
    assert copied.scale is not original.scale and torch.equal(copied.scale, original.scale)
    copied.scale.add_(1.0)                     # a forward that moves a buffer moves the copy's alone
    copied.encoder = nn.Identity()
    assert float(original.scale) == 2.0 and isinstance(original.encoder, nn.Linear)
    x = torch.randn(2, 6)
    assert torch.allclose(clone_sharing_weights(original)(x), original(x))
