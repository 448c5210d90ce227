"""The only part of xform that reaches into torch's private APIs.

Everything else in xform imports torch's public names only, and what it needs of
`torch._dynamo`, `torch._inductor`, `torch._guards`, `torch._C`, `torch._subclasses`,
`torch._functorch`, private operators and the allocator's private calls it takes from here
(`tests/test_private_torch_api.py` fails otherwise). Each difference between the torch
versions xform supports (2.11 to 2.14) is named once, in `versions`.

- `versions`   feature flags: what differs between torch versions, and which versions
- `dynamo`     the frame Dynamo is compiling: locals, sources, the guard set, its signals
- `inductor`   Inductor's and AOTAutograd's compile entry points and config
- `dispatch`   fake tensors, op overloads, tensor subclasses, torch-function and private operators
- `pytree`     torch's pytree utilities
- `distributed` torch.distributed's functional collectives
- `functorch`  functorch (vmap) kept on where an exception left it off
- `memory`     storages and the CUDA caching allocator: pools, unowned storages, invalidation
- `modules`    nn.Module's private state: tensors converted in place, state-dict hooks, hooks carried over
- `flex_attention` flex_attention's private helpers
- `logs`       torch's logging registry (TORCH_LOGS=xform)
"""
