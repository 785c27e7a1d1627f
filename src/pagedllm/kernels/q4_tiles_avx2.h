#pragma once
#include "q4_tiles_portable.h"
