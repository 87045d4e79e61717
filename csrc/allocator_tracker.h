// Registry of live CUDA caching-allocator blocks (filled in by the tracker component).
#pragma once
