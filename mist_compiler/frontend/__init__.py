"""Capture: dynamo backend entry, joint forward+backward ATen graphs under FakeTensorMode, block discovery."""
