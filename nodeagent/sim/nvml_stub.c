/*
 * A stand-in for libnvidia-ml.so.1: the NVML calls Ringmaster's GPU collectors make,
 * answered from a text state file, so the real pynvml code path runs on machines
 * without a GPU (tests, the simulated local cluster).
 *
 * The state file is "nvml-state.txt" in the directory this library was loaded from
 * (found with dladdr), so every simulated node gets its own copy of the library and its
 * own answers without any environment variable. It is re-read whenever its inode,
 * size or mtime changes; writers replace it atomically (write, then rename over).
 *
 * Format, one record a line, '#' starts a comment:
 *   init_error <code>                 nvmlInitWithFlags returns <code> (0: success)
 *   driver <version>
 *   gpu <i> <key> <value>             key: name uuid bus temp slowdown shutdown reasons
 *                                     tx_kbps rx_kbps replay util mem_util mem_total
 *                                     mem_used lost
 *   gpu <i> fail <function> <code>    <function> returns <code> for GPU <i>
 *   topo <a> <b> <level>              nvmlDeviceGetTopologyCommonAncestor (0..50)
 *   link <i> <link> <active> <remote_type> <remote_bus>
 *   xid <seq> <gpu> <code>            an XID critical error; <seq> increases
 * The GPU count is one more than the highest GPU index mentioned.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};
#define XID_CRITICAL 0x8ULL

#define MAX_GPUS 16
#define MAX_LINKS 36
#define MAX_FAILS 8
#define MAX_XIDS 256

struct link {
    int active, remote_type;
    char bus[32];
};

struct gpu {
    char name[96], uuid[96], bus[32];
    unsigned temp, slowdown, shutdown, tx, rx, replay, util, mem_util;
    unsigned long long reasons, mem_total, mem_used;
    int lost, nlinks, nfails;
    struct link links[MAX_LINKS];
    struct {
        char fn[64];
        int code;
    } fails[MAX_FAILS];
};

struct xid {
    unsigned long long seq, code;
    int gpu;
};

struct state {
    int init_error, count, nxids;
    char driver[80];
    int topo[MAX_GPUS][MAX_GPUS];
    struct gpu gpus[MAX_GPUS];
    struct xid xids[MAX_XIDS];
};

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    struct gpu *device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

struct event_set {
    unsigned long long mask[MAX_GPUS];
    unsigned long long delivered;
    int inotify; /* watches the state file's directory: waits sleep until it changes */
};

static struct state S, scratch;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char state_path[4096];
static struct stat seen;
static int initialized;

static void set_text(char *dst, size_t size, const char *src) {
    snprintf(dst, size, "%s", src);
    dst[strcspn(dst, "\n")] = '\0';
}

static void parse_gpu(struct state *st, int i, const char *key, const char *value) {
    struct gpu *g = &st->gpus[i];
    if (i + 1 > st->count)
        st->count = i + 1;
    if (!strcmp(key, "name")) set_text(g->name, sizeof g->name, value);
    else if (!strcmp(key, "uuid")) set_text(g->uuid, sizeof g->uuid, value);
    else if (!strcmp(key, "bus")) set_text(g->bus, sizeof g->bus, value);
    else if (!strcmp(key, "temp")) g->temp = strtoul(value, NULL, 0);
    else if (!strcmp(key, "slowdown")) g->slowdown = strtoul(value, NULL, 0);
    else if (!strcmp(key, "shutdown")) g->shutdown = strtoul(value, NULL, 0);
    else if (!strcmp(key, "reasons")) g->reasons = strtoull(value, NULL, 0);
    else if (!strcmp(key, "tx_kbps")) g->tx = strtoul(value, NULL, 0);
    else if (!strcmp(key, "rx_kbps")) g->rx = strtoul(value, NULL, 0);
    else if (!strcmp(key, "replay")) g->replay = strtoul(value, NULL, 0);
    else if (!strcmp(key, "util")) g->util = strtoul(value, NULL, 0);
    else if (!strcmp(key, "mem_util")) g->mem_util = strtoul(value, NULL, 0);
    else if (!strcmp(key, "mem_total")) g->mem_total = strtoull(value, NULL, 0);
    else if (!strcmp(key, "mem_used")) g->mem_used = strtoull(value, NULL, 0);
    else if (!strcmp(key, "lost")) g->lost = atoi(value);
    else if (!strcmp(key, "fail") && g->nfails < MAX_FAILS) {
        char fn[64];
        int code;
        if (sscanf(value, "%63s %d", fn, &code) == 2) {
            set_text(g->fails[g->nfails].fn, sizeof g->fails[0].fn, fn);
            g->fails[g->nfails++].code = code;
        }
    }
}

static void parse_line(struct state *st, char *line) {
    char key[64], bus[32];
    int a, b, c, d, n = 0;
    unsigned long long seq, code;
    if (line[0] == '#' || line[0] == '\n')
        return;
    if (sscanf(line, "init_error %d", &a) == 1) st->init_error = a;
    else if (sscanf(line, "driver %79s", st->driver) == 1) return;
    else if (sscanf(line, "gpu %d %63s %n", &a, key, &n) == 2 && n && a >= 0 && a < MAX_GPUS)
        parse_gpu(st, a, key, line + n);
    else if (sscanf(line, "topo %d %d %d", &a, &b, &c) == 3 && a >= 0 && a < MAX_GPUS &&
             b >= 0 && b < MAX_GPUS)
        st->topo[a][b] = c;
    else if (sscanf(line, "link %d %d %d %d %31s", &a, &b, &c, &d, bus) == 5 && a >= 0 &&
             a < MAX_GPUS && b >= 0 && b < MAX_LINKS) {
        struct link *l = &st->gpus[a].links[b];
        l->active = c;
        l->remote_type = d;
        set_text(l->bus, sizeof l->bus, bus);
        if (b + 1 > st->gpus[a].nlinks)
            st->gpus[a].nlinks = b + 1;
    } else if (sscanf(line, "xid %llu %d %llu", &seq, &a, &code) == 3 && st->nxids < MAX_XIDS) {
        st->xids[st->nxids].seq = seq;
        st->xids[st->nxids].gpu = a;
        st->xids[st->nxids++].code = code;
    }
}

/* Re-read the state file if it changed; call with the lock held. A missing or unreadable
 * file leaves the last answers in place, as a driver keeps answering between updates. */
static void refresh(void) {
    struct stat now;
    if (!state_path[0]) {
        Dl_info info;
        if (dladdr((void *)refresh, &info) && info.dli_fname) {
            set_text(state_path, sizeof state_path, info.dli_fname);
            char *slash = strrchr(state_path, '/');
            size_t dir = slash ? (size_t)(slash - state_path + 1) : 0;
            snprintf(state_path + dir, sizeof state_path - dir, "nvml-state.txt");
        }
    }
    if (stat(state_path, &now) != 0)
        return;
    if (now.st_ino == seen.st_ino && now.st_size == seen.st_size &&
        now.st_mtim.tv_sec == seen.st_mtim.tv_sec && now.st_mtim.tv_nsec == seen.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(state_path, "r");
    if (!f)
        return;
    memset(&scratch, 0, sizeof scratch);
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0)
        parse_line(&scratch, line);
    free(line);
    fclose(f);
    memcpy(&S, &scratch, sizeof S);
    seen = now;
}

/* Common entry for per-device calls: initialised, a valid handle, not lost, no injected
 * failure for this function. Takes the lock; the caller releases it. */
static nvmlReturn_t enter(struct gpu *dev, const char *fn) {
    pthread_mutex_lock(&lock);
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    refresh();
    if (!dev || dev < S.gpus || dev >= S.gpus + S.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (dev->lost)
        return NVML_ERROR_GPU_IS_LOST;
    for (int i = 0; i < dev->nfails; i++)
        if (!strcmp(dev->fails[i].fn, fn))
            return dev->fails[i].code;
    return NVML_SUCCESS;
}

#define ENTER(dev)                                   \
    nvmlReturn_t rc_ = enter((dev), __func__);       \
    if (rc_ != NVML_SUCCESS) {                       \
        pthread_mutex_unlock(&lock);                 \
        return rc_;                                  \
    }
#define LEAVE(value)                                 \
    do {                                             \
        pthread_mutex_unlock(&lock);                 \
        return (value);                              \
    } while (0)

static nvmlReturn_t copy_text(char *dst, unsigned size, const char *src) {
    if (strlen(src) + 1 > size)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

static void fill_pci(nvmlPciInfo_t *pci, const char *bus) {
    memset(pci, 0, sizeof *pci);
    set_text(pci->busId, sizeof pci->busId, bus);
    set_text(pci->busIdLegacy, sizeof pci->busIdLegacy, bus);
    sscanf(bus, "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
    pci->pciDeviceId = 0x233010de;
}

nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    refresh();
    initialized = S.init_error == NVML_SUCCESS;
    LEAVE(S.init_error);
}

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = initialized ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    initialized = 0;
    LEAVE(rc);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned length) {
    pthread_mutex_lock(&lock);
    if (!initialized)
        LEAVE(NVML_ERROR_UNINITIALIZED);
    refresh();
    LEAVE(copy_text(version, length, S.driver));
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    pthread_mutex_lock(&lock);
    if (!initialized)
        LEAVE(NVML_ERROR_UNINITIALIZED);
    refresh();
    *count = (unsigned)S.count;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, struct gpu **device) {
    pthread_mutex_lock(&lock);
    if (!initialized)
        LEAVE(NVML_ERROR_UNINITIALIZED);
    refresh();
    if (index >= (unsigned)S.count)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *device = &S.gpus[index];
    LEAVE(S.gpus[index].lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetName(struct gpu *dev, char *name, unsigned length) {
    ENTER(dev);
    LEAVE(copy_text(name, length, dev->name));
}

nvmlReturn_t nvmlDeviceGetUUID(struct gpu *dev, char *uuid, unsigned length) {
    ENTER(dev);
    LEAVE(copy_text(uuid, length, dev->uuid));
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(struct gpu *dev, nvmlPciInfo_t *pci) {
    ENTER(dev);
    fill_pci(pci, dev->bus);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(struct gpu *a, struct gpu *b, int *level) {
    ENTER(a);
    if (!b || b < S.gpus || b >= S.gpus + S.count)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (b->lost)
        LEAVE(NVML_ERROR_GPU_IS_LOST);
    int i = (int)(a - S.gpus), j = (int)(b - S.gpus);
    *level = S.topo[i][j] ? S.topo[i][j] : S.topo[j][i];
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t find_link(struct gpu *dev, unsigned link) {
    if (dev->nlinks == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= (unsigned)dev->nlinks)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(struct gpu *dev, unsigned link, unsigned *active) {
    ENTER(dev);
    nvmlReturn_t rc = find_link(dev, link);
    if (rc == NVML_SUCCESS)
        *active = (unsigned)dev->links[link].active;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(struct gpu *dev, unsigned link,
                                                 nvmlPciInfo_t *pci) {
    ENTER(dev);
    nvmlReturn_t rc = find_link(dev, link);
    if (rc == NVML_SUCCESS)
        fill_pci(pci, dev->links[link].bus);
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(struct gpu *dev, unsigned link, int *type) {
    ENTER(dev);
    nvmlReturn_t rc = find_link(dev, link);
    if (rc == NVML_SUCCESS)
        *type = dev->links[link].remote_type;
    LEAVE(rc);
}

nvmlReturn_t nvmlDeviceGetTemperature(struct gpu *dev, int sensor, unsigned *temp) {
    ENTER(dev);
    if (sensor != 0)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *temp = dev->temp;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(struct gpu *dev, int which, unsigned *temp) {
    ENTER(dev);
    if (which == 0)
        *temp = dev->shutdown;
    else if (which == 1)
        *temp = dev->slowdown;
    else
        LEAVE(NVML_ERROR_NOT_SUPPORTED);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(struct gpu *dev,
                                                    unsigned long long *reasons) {
    ENTER(dev);
    *reasons = dev->reasons;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(struct gpu *dev, int counter, unsigned *value) {
    ENTER(dev);
    if (counter != 0 && counter != 1)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *value = counter == 0 ? dev->tx : dev->rx;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(struct gpu *dev, unsigned *value) {
    ENTER(dev);
    *value = dev->replay;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(struct gpu *dev, unsigned util[2]) {
    ENTER(dev);
    util[0] = dev->util;
    util[1] = dev->mem_util;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(struct gpu *dev, unsigned long long memory[3]) {
    ENTER(dev);
    memory[0] = dev->mem_total;
    memory[1] = dev->mem_total - dev->mem_used;
    memory[2] = dev->mem_used;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlEventSetCreate(struct event_set **set) {
    pthread_mutex_lock(&lock);
    if (!initialized)
        LEAVE(NVML_ERROR_UNINITIALIZED);
    refresh();
    struct event_set *s = calloc(1, sizeof *s);
    if (!s)
        LEAVE(NVML_ERROR_UNKNOWN);
    for (int i = 0; i < S.nxids; i++) /* only errors raised after the set exists */
        if (S.xids[i].seq > s->delivered)
            s->delivered = S.xids[i].seq;
    s->inotify = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (s->inotify >= 0) {
        char dir[sizeof state_path];
        set_text(dir, sizeof dir, state_path);
        char *slash = strrchr(dir, '/');
        if (slash)
            *slash = '\0';
        if (inotify_add_watch(s->inotify, slash ? dir : ".", IN_CLOSE_WRITE | IN_MOVED_TO) < 0) {
            close(s->inotify);
            s->inotify = -1;
        }
    }
    *set = s;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(struct gpu *dev, unsigned long long types,
                                      struct event_set *set) {
    ENTER(dev);
    if (!set)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (types & ~XID_CRITICAL)
        LEAVE(NVML_ERROR_NOT_SUPPORTED);
    set->mask[dev - S.gpus] |= types;
    LEAVE(NVML_SUCCESS);
}

/* Wait until an XID newer than the last delivered one appears on a registered GPU, or the
 * timeout passes: asleep on inotify until the state file is replaced (as a driver sleeps
 * until the GPU interrupts), or polling every 10 ms without inotify. The lock is dropped
 * while waiting. */
nvmlReturn_t nvmlEventSetWait_v2(struct event_set *set, nvmlEventData_t *data, unsigned ms) {
    struct timespec start, now, pause = {0, 10 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&lock);
        if (!initialized)
            LEAVE(NVML_ERROR_UNINITIALIZED);
        refresh();
        const struct xid *next = NULL;
        for (int i = 0; i < S.nxids; i++) {
            const struct xid *x = &S.xids[i];
            if (x->seq > set->delivered && x->gpu >= 0 && x->gpu < S.count &&
                (set->mask[x->gpu] & XID_CRITICAL) && (!next || x->seq < next->seq))
                next = x;
        }
        if (next) {
            set->delivered = next->seq;
            memset(data, 0, sizeof *data);
            data->device = &S.gpus[next->gpu];
            data->eventType = XID_CRITICAL;
            data->eventData = next->code;
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            LEAVE(NVML_SUCCESS);
        }
        pthread_mutex_unlock(&lock);
        clock_gettime(CLOCK_MONOTONIC, &now);
        long elapsed = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (elapsed >= (long)ms)
            return NVML_ERROR_TIMEOUT;
        if (set->inotify >= 0) {
            struct pollfd ready = {set->inotify, POLLIN, 0};
            char drain[4096];
            if (poll(&ready, 1, (int)((long)ms - elapsed)) > 0)
                while (read(set->inotify, drain, sizeof drain) > 0) {
                }
        } else {
            nanosleep(&pause, NULL);
        }
    }
}

nvmlReturn_t nvmlEventSetFree(struct event_set *set) {
    if (set && set->inotify >= 0)
        close(set->inotify);
    free(set);
    return NVML_SUCCESS;
}
