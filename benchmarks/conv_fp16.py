"""One convolution's backward (input and weight gradients) per dtype on this CPU: why native fp16-mixed crawls
on CNNs where the CPU has AVX512-FP16 (torch's CPU fp16 weight-gradient convolution takes a slow path).

    PYTHONPATH=src python benchmarks/conv_fp16.py
"""

import time

import torch


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; conv 256x32x14x14 * 64x32x3x3, padding 1")
    for channels_last in (False, True):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            x, w = torch.randn(256, 32, 14, 14), torch.randn(64, 32, 3, 3)
            if channels_last:
                x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
            times = []
            for _ in range(3):
                a, b = x.to(dt).requires_grad_(), w.to(dt).requires_grad_()
                y = torch.nn.functional.conv2d(a, b, padding=1)
                t0 = time.perf_counter()
                y.sum().backward()
                times.append(time.perf_counter() - t0)
            layout = "channels_last" if channels_last else "nchw"
            print(f"| {layout} | {str(dt).removeprefix('torch.')} | {sorted(times)[1] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
