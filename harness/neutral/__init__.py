"""What every framework shares, so that each trains the same model on the same data: ``models`` (layers, shapes,
parameter counts, FLOPs, canonical weights and layouts) and ``datasets`` (digits, synthetic, CIFAR-10; batch order
and augmentation from (seed, epoch)). Imports only ``harness.spec``, numpy and scikit-learn's bundled data; adapters
import it in their worker processes."""
