#include "allocator_tracker.h"
