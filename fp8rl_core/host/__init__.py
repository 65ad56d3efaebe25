"""Host settings that are not numerics: CPU environment, allocator, device discipline, quiet imports."""
