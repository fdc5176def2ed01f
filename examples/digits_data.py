"""scikit-learn's handwritten digits, split and standardized the same way on every rank.

Shared by the examples (they run as scripts, so this file is importable from their folder). The
data (1,797 8x8 images, 10 classes) ships inside scikit-learn: nothing is downloaded.
"""
import torch


def load_digits_tensors(seed=0, test_fraction=0.2, flat=False):
    """((x_train, y_train), (x_test, y_test)).

    flat=False: images as N x 1 x 8 x 8, standardized with the training set's global mean and std.
    flat=True: N x 64 features, each standardized with its own training mean and std.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    if flat:
        x = torch.tensor(data.data, dtype=torch.float32)
    else:
        x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # in [0, 1]
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    if flat:
        mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-3)
    else:
        mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return (x[train], y[train]), (x[test], y[test])
